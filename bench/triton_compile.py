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

Then (unless --no-capture) torch.compile's view of those launches: the model compiled for training
at the record's scope, captured on the CPU (AOT autograd, no code generation) once with the torch
twins (what bench/gpu_proof.py's correct phase expects of a GPU) and once with the GPU's fused loss
and MLP, their launches recorded rather than run (dynamo told Triton is usable, as where a GPU is):
the same graphs, no graph break, every fused kernel traced.

Prints per kernel, specialization and config: shared memory against the architecture's limit per
block (a config over it is skipped by the autotuner), compile seconds; then a summary and the
capture. Exit status 1 if any compile failed, some kernel's specialization has no config that
fits, or the capture differs.

Usage: python bench/triton_compile.py [--arch 90] [--json PATH] [--no-capture]
"""

import contextlib
import json
import os
import sys
import time
from unittest import mock

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


@contextlib.contextmanager
def launches_recorded(tg, every_config=True):
    """Within: a Triton launch records (kernel, signature, constexprs, attrs, options) in the list
    yielded, and neither compiles nor runs (outputs stay as allocated); an autotuned kernel records
    each config of its list (every_config) or its first. The wrappers take CPU tensors."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction
    launches, seen = [], set()

    def record(self, key, signature, device, constexprs, options, attrs, warmup):
        name = (self.fn.__name__, repr(sorted(signature.items())), repr(sorted(constexprs.items())),
                repr(sorted(attrs.items())), repr(options))
        if name not in seen:
            seen.add(name)
            launches.append((self, dict(signature), dict(constexprs), dict(attrs), options))
        return None  # JITFunction.run then returns without launching

    def configs(self, *args, **kwargs):
        kwargs.pop("grid", None)
        kwargs.pop("warmup", None)
        for config in self.configs if every_config else self.configs[:1]:
            self.fn.run(*args, grid=None, warmup=True, **kwargs, **config.all_kwargs())

    saved = JITFunction._do_compile, JITFunction.run, Autotuner.run
    plain_run = JITFunction.run
    JITFunction._do_compile = record
    JITFunction.run = lambda self, *a, grid, warmup, **kw: plain_run(self, *a, grid=grid, warmup=True, **kw)
    Autotuner.run = configs
    tg.TRITON_INTERPRETING, interpreting = True, tg.TRITON_INTERPRETING  # the wrappers' CPU-tensor check only
    try:
        yield launches
    finally:
        JITFunction._do_compile, JITFunction.run, Autotuner.run = saved
        tg.TRITON_INTERPRETING = interpreting


def capture_launches(tg, torch):
    """Every launch the trainer's wrappers make at the speedrun's shapes, each autotuned kernel at
    every config; nothing is compiled or run."""
    from bench.gpu_proof import muon_layout
    with launches_recorded(tg) as launches:
        bf16 = dict(dtype=torch.bfloat16)
        for (rows, cols), count in muon_layout(tg, torch)["per_rank"][8].items():
            for method in tg.NS_METHODS:  # uninitialized inputs: only shapes, strides and dtypes matter
                tg.orthogonalize_triton(torch.empty(count, rows, cols, **bf16), method)
        x, fc = torch.empty(128, 768, **bf16), torch.empty(768, 3072, **bf16)
        pre, _ = tg.relu_square_matmul_triton(x, fc)
        tg.relu_square_matmul_triton(x, fc, pre)  # the backward's epilogue
        tokens = torch.zeros(65, dtype=torch.long)  # targets: the loader's tokens[1:], 8 bytes off alignment
        for weights in ([1.0, 0.5, 0.25], [1.0]):  # the last third's single weight: n_weights == 1, a constexpr
            logits = torch.empty(64, 50304, **bf16, requires_grad=True)
            tg.CappedMultiTokenLoss.apply(logits, tokens[1:], torch.tensor(weights), 23.0, 5.0, 7.5).sum().backward()
    return launches


@contextlib.contextmanager
def dynamo_sees_triton(torch):
    """torch.compile treats Triton kernels as it does where a GPU is (has_triton() is False on a
    CPU-only machine, and dynamo would trace into Triton's launcher instead)."""
    import torch.utils._triton as triton_utils
    original = triton_utils.has_triton

    def usable():
        return True

    for module in [m for m in list(sys.modules.values()) if getattr(m, "has_triton", None) is original]:
        module.has_triton = usable
    try:
        yield
    finally:  # modules imported inside took the stand-in by name too
        for module in [m for m in list(sys.modules.values()) if getattr(m, "has_triton", None) is usable]:
            module.has_triton = original


def capture_compiled(tg, torch):
    """The model compiled for training at the record's scope (gpu_proof.compile_counts: a training
    step and a validation pass at two window sizes, AOT autograd, no code generation) with the
    torch twins, as the CPU capture bench/gpu_proof.py expects, and with the GPU's fused loss and
    MLP: their graphs, graph breaks and the Triton launches traced; and the fused loss compiled
    alone, its kernels' place in the forward and backward graphs."""
    import dataclasses
    from bench.gpu_proof import compile_counts
    layout = ["--preset", "speedrun", "--num_layers", "4", "--window_pattern", "LSSL", "--attention_free_layers", "2",
              "--num_value_embeds", "1", "--value_embed_layers", "0..0", "--paired_head_layers", "1",
              "--skip_layers", "1,3", "--backout_layer", "1", "--device", "cpu", "--model_dim", "32",
              "--num_heads", "2", "--head_dim", "16", "--attn_block_size", "32", "--train_seq_len", "32",
              "--val_seq_len", "128", "--compile_scope", "model"]
    out = dict(twins=compile_counts(tg, torch, layout, False, "aot_eager", fp8_head=True))
    detect = tg.Hardware.detect
    gpu_backends = staticmethod(lambda args: dataclasses.replace(detect(args), ce_backend="triton", mlp_backend="triton"))
    with mock.patch.object(tg.Hardware, "detect", gpu_backends), dynamo_sees_triton(torch), \
            launches_recorded(tg, every_config=False) as launches:
        out["gpu_kernels"] = compile_counts(tg, torch, layout, False, "aot_eager", fp8_head=True)
    out["gpu_kernels"]["launched"] = sorted({fn.fn.__name__ for fn, *_ in launches})
    from torch._dynamo.backends.common import aot_autograd
    graphs = {}

    def keep(kind):
        def compiler(graph, example_inputs):
            graphs[kind] = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
            return graph
        return compiler

    loss = torch.compile(lambda logits, targets, weights: tg.CappedMultiTokenLoss.apply(
        logits, targets, weights, 23.0, 5.0, 7.5).sum(), fullgraph=True, dynamic=False,
        backend=aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward")))
    torch._dynamo.reset()
    with dynamo_sees_triton(torch), launches_recorded(tg, every_config=False):
        logits = torch.empty(64, 512, dtype=torch.bfloat16, requires_grad=True)
        loss(logits, torch.zeros(64, dtype=torch.long), torch.tensor([1.0, 0.5, 0.25])).backward()
    torch._dynamo.reset()
    out["loss_kernels_in_graph"] = {kind: ops.count("triton_kernel_wrapper_functional") for kind, ops in graphs.items()}
    return out


def kernels_of(tg):
    """train_gpt's launched kernels: its Triton functions that no other one calls."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction
    found = {name: obj for name, obj in vars(tg).items() if isinstance(obj, (JITFunction, Autotuner))}
    sources = {name: (obj.fn if isinstance(obj, Autotuner) else obj).src for name, obj in found.items()}
    return sorted(name for name in found if not any(f"{name}(" in src for other, src in sources.items() if other != name))


def compile_all(arch, capture=True):
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
            spec = ", ".join([dtype] + [f"{k}={v}" for k, v in flags.items() if isinstance(v, bool)
                                        or not k.startswith(("BLOCK", "stride")) and isinstance(v, int)])
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
    try:
        capture = capture_compiled(tg, torch) if capture else None
    except Exception as e:  # noqa: BLE001 - reported with the compiles
        capture = dict(error=f"{type(e).__name__}: {' '.join(str(e).split())[-600:]}")
    return dict(triton=triton.__version__, torch=torch.__version__, arch=arch, shared_limit=SHARED_LIMIT.get(arch),
                kernels=expected, configs=configs, rows=rows, capture=capture)


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
                  f"{sum(r['seconds'] for r in rows):.0f} s (a kernel in Triton's cache takes ~0 s): {len(failed)} failed; "
                  + (f"{len(over)} configs over the shared-memory limit (the autotuner skips them)" if over
                     else "every config fits in shared memory" if limit else "shared-memory limit unknown")]
    for r in failed:
        lines.append(f"FAILED {r['kernel']} ({r['launch']}, {r['specialization']}, {r['config']}): {r['error']}")
    for g in no_fit:
        lines.append(f"NO CONFIG LEFT {g[0]} ({g[1]}, {g[2]}): every config failed or is over the limit")
    for name in missing:
        lines.append(f"NOT REACHED {name}: no wrapper launched it (add it to capture_launches)")
    capture, capture_bad = report["capture"], True
    if capture is None:
        capture_bad = False
    elif "error" in capture:
        lines.append(f"FAILED the torch.compile capture: {capture['error']}")
    else:
        counts = lambda c: (f"{c['graphs_round1']} graphs, {c['graph_breaks']} graph breaks, "  # noqa: E731
                            f"{c['new_graphs_round2']} new at a later window")
        twins, gpu, in_graph = capture["twins"], capture["gpu_kernels"], capture["loss_kernels_in_graph"]
        fused = ["_capped_loss_bwd_kernel", "_capped_loss_fwd_kernel", "_relu_square_matmul_kernel"]
        capture_bad = not (gpu["graphs_round1"] == twins["graphs_round1"] and gpu["graph_breaks"] == 0
                           and gpu["new_graphs_round2"] == 0 and gpu["launched"] == fused
                           and in_graph == {"forward": 1, "backward": 1})
        lines += ["", "torch.compile of the model for training, the record's scope (CPU capture: AOT autograd, no code "
                      "generation; a 4-block layout):",
                  f"  torch twins (the CPU capture bench/gpu_proof.py expects): {counts(twins)}",
                  f"  the GPU's fused loss and MLP: {counts(gpu)}; kernels traced: {', '.join(gpu['launched']) or 'none'}",
                  f"  the fused loss compiled alone: {in_graph.get('forward', 0)} kernel in its forward graph, "
                  f"{in_graph.get('backward', 0)} in its backward" + ("" if not capture_bad else "  NOT AS EXPECTED")]
    return "\n".join(lines), bool(failed or no_fit or missing or capture_bad)


def main(argv=None):
    p = OneLineArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10: 90 (H100, H200; the default), "
                   + ", ".join(f"{a} ({name})" for a, name in GPU_NAMES.items() if a != 90))
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows to PATH as JSON")
    p.add_argument("--no-capture", action="store_true", help="compile the kernels only: no torch.compile capture")
    opts = p.parse_args(argv)
    if opts.arch not in SHARED_LIMIT:
        p.error(f"--arch={opts.arch}: expected one of {', '.join(map(str, SHARED_LIMIT))} (compute capability x 10)")
    if opts.json and os.path.exists(opts.json):
        p.error(f"--json={opts.json}: already exists; give a new file path")
    if opts.json and not os.path.isdir(os.path.dirname(os.path.abspath(opts.json))):
        p.error(f"--json={opts.json}: its folder does not exist")
    report = compile_all(opts.arch, capture=not opts.no_capture)
    text, bad = summarize(report)
    print(text)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
