"""Compile every Triton kernel of train_gpt.py for a GPU architecture, on a machine without that GPU.

The interpreter (TRITON_INTERPRET=1, what the tests run on CPU) executes a kernel's Python body
with numpy: it never type-checks loops, never lays out tl.dot for tensor cores and never
allocates shared memory, so a kernel it runs can still fail to compile on a GPU. This script
compiles each kernel the way a GPU run would, down to a cubin (Triton's own ptxas), without a GPU:
a stand-in driver answers Triton's one question, the target, and nothing is launched.

The kernels are reached through the trainer's own wrappers at the speedrun's shapes (each Muon
stack shape, an MLP of width 768, the 50304-wide loss) with CPU tensors of the dtypes a GPU run
gives them (bf16), so each kernel gets the specialization (dtypes, constexpr flags, alignment,
unit strides) of the real launch; an autotuned kernel compiles at every config of its list.
A kernel with a float argument compiles again with it as fp64, as torch.compile passes Python
floats (inductor's user-defined-kernel signature), for the kernels the compiled model and
orthogonalizer launch.

Prints per kernel, specialization and config: shared memory against the architecture's limit per
block (a config over it is skipped by the autotuner), compile seconds; then a summary. Exit status
1 if any compile failed, or some kernel's specialization has no config that fits.

Usage: python bench/triton_compile.py [--arch 90] [--json PATH]
"""

import json
import os
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)  # before triton is imported: real compilation, not the interpreter

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

from data.cli_util import OneLineArgumentParser  # noqa: E402

# Largest shared memory a block may opt into, bytes (CUDA programming guide, compute capabilities)
SHARED_LIMIT = {80: 166912, 86: 101376, 87: 166912, 89: 101376, 90: 232448, 100: 232448, 120: 101376}
GPU_NAMES = {80: "A100", 86: "RTX 30", 87: "Orin", 89: "L4, L40, RTX 40", 90: "H100, H200", 100: "B200",
             120: "RTX 50"}


class TargetOnly:
    """Triton's driver, as far as compilation asks it: the target. No device, nothing launches."""

    def __init__(self, arch):
        from triton.backends.compiler import GPUTarget
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def is_active(self):
        return True


def capture_launches(tg, torch):
    """Every (kernel, signature, constexprs, attrs, options) the trainer's wrappers launch at the
    speedrun's shapes, each autotuned kernel once per config; nothing is compiled or run."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction
    from bench.gpu_proof import muon_layout
    launches = {}

    def capture(self, key, signature, device, constexprs, options, attrs, warmup):
        entry = (self, dict(signature), dict(constexprs), dict(attrs), options)
        launches.setdefault((self.fn.__name__, repr(sorted(signature.items())), repr(sorted(constexprs.items())),
                             repr(options)), entry)
        return None  # JITFunction.run then returns without launching

    def every_config(self, *args, **kwargs):
        kwargs.pop("grid", None)
        kwargs.pop("warmup", None)
        for config in self.configs:
            self.fn.run(*args, grid=None, warmup=True, **kwargs, **config.all_kwargs())

    saved = JITFunction._do_compile, JITFunction.run, Autotuner.run
    plain_run = JITFunction.run
    JITFunction._do_compile = capture
    JITFunction.run = lambda self, *a, grid, warmup, **kw: plain_run(self, *a, grid=grid, warmup=True, **kw)
    Autotuner.run = every_config
    tg.TRITON_INTERPRETING, interpreting = True, tg.TRITON_INTERPRETING  # the wrappers' CPU-tensor check only
    try:
        bf16 = dict(dtype=torch.bfloat16)
        for (rows, cols), count in muon_layout(tg, torch)["per_rank"][8].items():
            for method in tg.NS_METHODS:  # uninitialized inputs: only shapes, strides and dtypes matter
                tg.orthogonalize_triton(torch.empty(count, rows, cols, **bf16), method)
        x, fc = torch.empty(128, 768, **bf16), torch.empty(768, 3072, **bf16)
        pre, _ = tg.relu_square_matmul_triton(x, fc)
        tg.relu_square_matmul_triton(x, fc, pre)  # the backward's epilogue
        logits = torch.empty(64, 50304, **bf16, requires_grad=True)
        weights = torch.tensor([1.0, 0.5, 0.25])
        tg.CappedMultiTokenLoss.apply(logits, torch.zeros(64, dtype=torch.long), weights, 23.0, 5.0, 7.5).sum().backward()
    finally:
        JITFunction._do_compile, JITFunction.run, Autotuner.run = saved
        tg.TRITON_INTERPRETING = interpreting
    return list(launches.values())


def kernels_of(tg):
    """train_gpt's launched kernels: its Triton functions that no other one calls."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction
    found = {name: obj for name, obj in vars(tg).items() if isinstance(obj, (JITFunction, Autotuner))}
    sources = {name: (obj.fn if isinstance(obj, Autotuner) else obj).src for name, obj in found.items()}
    return sorted(name for name in found if not any(f"{name}(" in src for other, src in sources.items() if other != name))


def compile_all(arch):
    import torch
    import triton
    from triton.compiler import ASTSource
    from triton.runtime import driver
    import train_gpt as tg
    if tg.triton is None:
        raise SystemExit("triton_compile.py: needs the triton package")
    driver.set_active(TargetOnly(arch))
    rows, expected = [], kernels_of(tg)
    for fn, signature, constexprs, attrs, options in capture_launches(tg, torch):
        floats = [k for k, v in signature.items() if v == "fp32"]  # scalar floats (pointers read "*fp32")
        variants = [("eager", signature)] + ([("compiled", {k: "fp64" if k in floats else v for k, v in signature.items()})]
                                             if floats else [])
        for launch, sig in variants:
            names = [p.name for p in fn.params]
            flags = {(names[k[0]] if isinstance(k, tuple) else k): v for k, v in constexprs.items()}
            dtype = next(v.lstrip("*") for v in sig.values() if v.startswith("*"))  # the first pointer's
            spec = ", ".join([dtype] + [f"{k}={v}" for k, v in flags.items() if isinstance(v, bool)])
            config = " ".join([f"{k}={v}" for k, v in flags.items() if k.startswith("BLOCK")]
                              + [f"warps={options.num_warps}", f"stages={options.num_stages}"])
            row = dict(kernel=fn.fn.__name__, launch=launch, specialization=spec, config=config,
                       floats="fp64" if launch == "compiled" else "fp32")
            start = time.perf_counter()
            try:
                compiled = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=driver.active.get_current_target(),
                                          options=options.__dict__)
                row.update(ok=True, shared=int(compiled.metadata.shared))
            except Exception as e:  # noqa: BLE001 - every failure is reported, the others still compile
                message = " ".join(str(e).split())
                row.update(ok=False, shared=None, error=f"{type(e).__name__}: {message[-400:]}")
            row["seconds"] = round(time.perf_counter() - start, 2)
            rows.append(row)
    configs = {name: len(getattr(getattr(tg, name), "configs", [None])) for name in expected}
    return dict(triton=triton.__version__, torch=torch.__version__, arch=arch, shared_limit=SHARED_LIMIT.get(arch),
                kernels=expected, configs=configs, rows=rows)


def summarize(report):
    limit, rows = report["shared_limit"], report["rows"]
    lines = [f"Triton {report['triton']}, torch {report['torch']}: train_gpt.py's kernels compiled for sm_{report['arch']}"
             f" ({GPU_NAMES.get(report['arch'], 'no GPU named here')}), shared memory per block at most "
             + (f"{limit:,} bytes" if limit else "unknown here"), ""]
    header = f"{'kernel':28} {'launch':8} {'specialization':34} {'config':44} {'shared':>9} {'s':>5}"
    lines += [header, "-" * len(header)]
    for r in rows:
        shared = "FAILED" if not r["ok"] else f"{r['shared']:,}" + ("" if limit is None or r["shared"] <= limit else " >")
        lines.append(f"{r['kernel']:28} {r['launch']:8} {r['specialization']:34} {r['config']:44} {shared:>9} "
                     f"{r['seconds']:5.1f}")
    failed = [r for r in rows if not r["ok"]]
    groups = {}
    for r in rows:
        groups.setdefault((r["kernel"], r["launch"], r["specialization"]), []).append(r)
    no_fit = [g for g, rs in groups.items()
              if not any(r["ok"] and (limit is None or r["shared"] <= limit) for r in rs)]
    over = [r for r in rows if r["ok"] and limit is not None and r["shared"] > limit]
    missing = sorted(set(report["kernels"]) - {r["kernel"] for r in rows})
    lines += ["", f"{len(rows)} compiles of {len({r['kernel'] for r in rows})} kernels in "
                  f"{sum(r['seconds'] for r in rows):.0f} s: {len(failed)} failed; "
                  + (f"{len(over)} configs over the shared-memory limit (the autotuner skips them)" if over
                     else "every config fits in shared memory" if limit else "shared-memory limit unknown")]
    for r in failed:
        lines.append(f"FAILED {r['kernel']} ({r['launch']}, {r['specialization']}, {r['config']}): {r['error']}")
    for g in no_fit:
        lines.append(f"NO CONFIG LEFT {g[0]} ({g[1]}, {g[2]}): every config failed or is over the limit")
    for name in missing:
        lines.append(f"NOT REACHED {name}: no wrapper launched it (add it to capture_launches)")
    return "\n".join(lines), bool(failed or no_fit or missing)


def main(argv=None):
    p = OneLineArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10: 90 (H100, H200; the default), "
                   + ", ".join(f"{a} ({name})" for a, name in GPU_NAMES.items() if a != 90))
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows to PATH as JSON")
    opts = p.parse_args(argv)
    if opts.arch not in SHARED_LIMIT:
        p.error(f"--arch={opts.arch}: expected one of {', '.join(map(str, SHARED_LIMIT))} (compute capability x 10)")
    if opts.json and os.path.exists(opts.json):
        p.error(f"--json={opts.json}: already exists; give a new file path")
    if opts.json and not os.path.isdir(os.path.dirname(os.path.abspath(opts.json))):
        p.error(f"--json={opts.json}: its folder does not exist")
    report = compile_all(opts.arch)
    text, bad = summarize(report)
    print(text)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
