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
orthogonalizer launch: at its first config only, as a scalar's type changes no tile.

Then (unless --no-capture) torch.compile's view of those launches: the model compiled for training
at the record's scope, captured on the CPU (AOT autograd, no code generation) once with the torch
twins (what bench/gpu_proof.py's correct phase expects of a GPU) and once with the GPU's fused loss
and MLP, their launches recorded rather than run (dynamo told Triton is usable, as where a GPU is):
the same graphs, no graph break, every fused kernel traced.

With --inductor (sm_90 only, minutes; not run by the tests), inductor's own code for the speedrun
preset's forward graphs on an H100: torch.cuda answers for an H100 that is not there, the model's
parameters are fake CUDA tensors, and inductor generates and compiles every kernel (FlexAttention's
templates among them) without loading or running one: step 0's training forward (with the fused
loss; the FP8 head and the fused MLP are custom ops, opaque to it) and a validation pass. Both are
traced under no_grad (inference graphs: no saved activations, FlexAttention without its
logsumexp); a training step's partitioned forward and the backward graphs are out of reach:
tracing them needs the autograd engine, which asks the CUDA driver for the device.

Prints per kernel, specialization and config: shared memory against the architecture's limit per
block (a config over it is skipped by the autotuner), compile seconds; then a summary and the
capture. Exit status 1 if any compile failed, some kernel's specialization has no config that
fits, the capture differs, or (--inductor) a forward graph failed or lacks what the preset's has.

Usage: python bench/triton_compile.py [--arch 90] [--json PATH] [--no-capture] [--inductor]
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

CAP = (23.0, 5.0, 7.5)  # the preset's soft cap (height, shift, width); a compile sees only that they are floats

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
            tg.CappedMultiTokenLoss.apply(logits, tokens[1:], torch.tensor(weights), *CAP).sum().backward()
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
    from bench.gpu_proof import CPU_CAPTURE_SIZES, SMOKE_LAYOUT, compile_counts
    layout = ["--preset", "speedrun", *SMOKE_LAYOUT, *CPU_CAPTURE_SIZES, "--compile_scope", "model"]  # the smoke run's
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
        logits, targets, weights, *CAP).sum(), fullgraph=True, dynamic=False,
        backend=aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward")))
    torch._dynamo.reset()
    with dynamo_sees_triton(torch), launches_recorded(tg, every_config=False):
        logits = torch.empty(64, 512, dtype=torch.bfloat16, requires_grad=True)
        loss(logits, torch.zeros(64, dtype=torch.long), torch.tensor([1.0, 0.5, 0.25])).backward()
    torch._dynamo.reset()
    out["loss_kernels_in_graph"] = {kind: ops.count("triton_kernel_wrapper_functional") for kind, ops in graphs.items()}
    return out


class CompiledNotRun(Exception):
    """Raised in place of running inductor's output: there is no GPU to run it on."""


@contextlib.contextmanager
def absent_h100(torch):
    """torch.cuda answers for an H100 that is not there, so that inductor generates its code for one
    and compiles its kernels (Triton's stand-in driver gives the target), never loading or launching
    them: the kernels are recorded by name. Inductor passes that would benchmark on the GPU (shape
    padding) or run ops on it (constant folding of the joint graph) are off."""
    import types
    import torch._inductor.config as inductor_config
    import torch._inductor.runtime.triton_helpers as triton_helpers
    from torch._dynamo.device_interface import CudaInterface
    from torch._inductor.runtime import triton_heuristics
    props = types.SimpleNamespace(
        name="NVIDIA H100 80GB HBM3 (absent)", major=9, minor=0, multi_processor_count=132, total_memory=80 * 2 ** 30,
        warp_size=32, max_threads_per_multi_processor=2048, max_threads_per_block=1024, regs_per_multiprocessor=65536,
        shared_memory_per_block_optin=SHARED_LIMIT[90], shared_memory_per_multiprocessor=233472,
        L2_cache_size=50 * 2 ** 20, gcnArchName="", is_integrated=False, uuid="0", clock_rate=1980000,
        memory_clock_rate=2619000, memory_bus_width=5120)
    kernels = []

    def record(self):  # in place of loading the compiled kernels onto the device
        kernels.append(self.inductor_meta.get("kernel_name") or "?")

    patches = [(torch.cuda, "device_count", lambda: 1), (torch.cuda, "current_device", lambda: 0),
               (torch.cuda, "get_device_properties", lambda device=None: props),
               (torch.cuda, "get_device_capability", lambda device=None: (9, 0)),
               (torch.cuda, "get_device_name", lambda device=None: props.name),
               (torch.cuda, "is_bf16_supported", lambda *a, **k: True),
               (CudaInterface, "get_device_properties", staticmethod(lambda device=None: props)),  # bound at import
               (CudaInterface, "current_device", staticmethod(lambda: 0)),
               (CudaInterface, "device_count", staticmethod(lambda: 1)),
               (CudaInterface, "is_bf16_supported", staticmethod(lambda *a, **k: True)),
               (triton_helpers, "set_driver_to_gpu", lambda: None),
               (triton_heuristics.CachingAutotuner, "_make_launchers", record),
               (triton_heuristics.CachingAutotuner, "_dynamic_scale_rblock", lambda self: None),
               (inductor_config, "compile_threads", 1),   # in this process, where the patches are
               (inductor_config, "joint_graph_constant_folding", False), (inductor_config, "shape_padding", False),
               (inductor_config, "fx_graph_cache", False)]
    with contextlib.ExitStack() as stack:
        for owner, name, value in patches:
            stack.enter_context(mock.patch.object(owner, name, value))
        stack.enter_context(dynamo_sees_triton(torch))
        yield kernels


def inductor_forward_graphs(tg, torch):
    """Inductor's code for the speedrun preset's forward graphs on an H100, generated and compiled
    without one (fake CUDA tensors, nothing runs): step 0's training forward (16Ki tokens, the
    embedding tied to the head, the fused loss; the FP8 head and the fused MLP are custom ops, opaque
    to inductor) and a validation pass. Traced under no_grad: inference graphs (no saved activations,
    FlexAttention without its logsumexp), not the partitioned forward of a training step, whose
    tracing, like the backward's, needs the autograd engine, which asks the CUDA driver for the device."""
    import dataclasses
    from torch._inductor.compile_fx import compile_fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    args = tg.harness("config").parse_config(["--preset", "speedrun"], {}, world_size=1, cuda_available=True)
    tg.register_fp8_ops()
    tg.register_mlp_ops()
    cuda = torch.device("cuda", 0)
    hw = dataclasses.replace(tg.Hardware.detect(args), device=cuda, compute_dtype=torch.bfloat16, attention="flex",
                             fp8_head=True, ns_backend="triton", ce_backend="triton", mlp_backend="triton")
    with torch.device("meta"):
        model = tg.GPT(args, dataclasses.replace(hw, device=torch.device("meta")))
    for module in model.modules():
        if hasattr(module, "hw"):
            module.hw = hw
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake:  # every parameter and buffer a fake CUDA tensor of its shape and dtype
        for module in model.modules():
            for name, p in list(module.named_parameters(recurse=False)):
                setattr(module, name, torch.nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=cuda),
                                                         requires_grad=p.requires_grad))
            for name, b in list(module.named_buffers(recurse=False)):
                setattr(module, name, torch.empty(b.shape, dtype=b.dtype, device=cuda))

    def backend(graph, example_inputs):
        compile_fx(graph, example_inputs)
        def not_run(*inputs):
            raise CompiledNotRun
        return not_run

    results = {}
    with absent_h100(torch) as kernels:
        for graph, training in (("training forward", True), ("validation forward", False)):
            torch._dynamo.reset()
            start, before = time.perf_counter(), len(kernels)
            model.train(training)
            model.embed_tied = tg.embed_tied_at(0, args)   # as train()'s enter_step(0) sets it
            T = tg.train_seq_len_at(0, args) if training else args.val_seq_len
            long = tg.long_window_blocks_at(0, args)
            with fake:
                tokens = torch.zeros(T + 1, dtype=torch.long, device=cuda)
                windows = [torch.tensor(b, device=cuda) for b in (long, tg.short_window_blocks(long))]
                mtp = torch.tensor(tg.mtp_weights_at(0, args), device=cuda) if training else None
                compiled = torch.compile(model, backend=backend, fullgraph=True, dynamic=False)
                try:
                    with torch.no_grad():
                        compiled(tokens[:-1], tokens[1:], *windows, mtp)
                    error = "ran: expected CompiledNotRun"
                except CompiledNotRun:
                    error = None
                except Exception as e:  # noqa: BLE001 - reported: the cause first, then where
                    words = ' '.join(str(e).split())
                    error = f"{type(e).__name__}: {words[:400]}" + (f" ... {words[-300:]}" if len(words) > 700 else words[400:])
            names = kernels[before:]
            # inductor names its kernels triton_*, FlexAttention's templates triton_tem_*flex_attention*; others are ours
            results[graph] = dict(tokens=T, kernels=len(names),
                                  flex_attention=sum(n.startswith("triton_tem_") and "flex_attention" in n for n in names),
                                  ours=sorted({n.rsplit("_", 1)[0] for n in names if not n.startswith("triton_")}),
                                  seconds=round(time.perf_counter() - start, 1), error=error)
        torch._dynamo.reset()
    return results


def kernels_of(tg):
    """train_gpt's launched kernels: its Triton functions that no other one calls."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction
    found = {name: obj for name, obj in vars(tg).items() if isinstance(obj, (JITFunction, Autotuner))}
    sources = {name: (obj.fn if isinstance(obj, Autotuner) else obj).src for name, obj in found.items()}
    return sorted(name for name in found if not any(f"{name}(" in src for other, src in sources.items() if other != name))


def compile_all(arch, capture=True, inductor=False):
    import torch
    import triton
    from triton.compiler import ASTSource
    from triton.runtime import driver
    import train_gpt as tg
    if tg.triton is None:
        raise SystemExit("triton_compile.py: needs the triton package")
    driver.set_active(TargetOnly(arch))
    rows, expected, fp64_compiled = [], kernels_of(tg), set()
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
            if launch == "compiled":  # fp64 scalars change no tile: the first config only (the rest: eager's rows)
                if (fn.fn.__name__, spec) in fp64_compiled:
                    continue
                fp64_compiled.add((fn.fn.__name__, spec))
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
    try:
        forward = inductor_forward_graphs(tg, torch) if inductor else None
    except Exception as e:  # noqa: BLE001 - reported with the compiles
        forward = dict(error=f"{type(e).__name__}: {' '.join(str(e).split())[-600:]}")
    return dict(triton=triton.__version__, torch=torch.__version__, arch=arch, shared_limit=SHARED_LIMIT.get(arch),
                kernels=expected, configs=configs, rows=rows, capture=capture, inductor=forward)


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
    forward, forward_bad = report["inductor"], False
    if forward is not None:
        lines += ["", "Inductor's code for the speedrun preset's forward graphs on an H100, generated and compiled without "
                      "one (the backward graphs need a CUDA driver):"]
        if "error" in forward and len(forward) == 1:
            forward_bad = True
            lines.append(f"  FAILED: {forward['error']}")
        for graph, r in ((g, r) for g, r in forward.items() if g != "error"):
            # nothing compiled, no FlexAttention, or the fused loss gone from training's graph: not the preset's graph
            missing = (r["error"] is None and (not r["kernels"] or not r["flex_attention"] or graph == "training forward"
                                               and "_capped_loss_fwd_kernel" not in r["ours"]))
            forward_bad |= r["error"] is not None or missing
            lines.append(f"  {graph} ({r['tokens']:,} tokens): " + (f"FAILED {r['error']}" if r["error"] else
                         f"{r['kernels']} kernels ({r['flex_attention']} FlexAttention templates; train_gpt's: "
                         f"{', '.join(r['ours']) or 'none'}) in {r['seconds']:.0f} s"
                         + ("  NOT THE PRESET'S GRAPH" if missing else "")))
        lines.append("  (under no_grad: inference graphs; kernels the two share are counted in both; inductor's shape "
                     "padding, joint-graph constant folding and reduction re-tuning, which need a GPU, are off)")
    return "\n".join(lines), bool(failed or no_fit or missing or capture_bad or forward_bad)


def main(argv=None):
    p = OneLineArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10: 90 (H100, H200; the default), "
                   + ", ".join(f"{a} ({name})" for a, name in GPU_NAMES.items() if a != 90))
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows to PATH as JSON")
    p.add_argument("--no-capture", action="store_true", help="compile the kernels only: no torch.compile capture")
    p.add_argument("--inductor", action="store_true", help="also generate and compile inductor's code for the "
                   "speedrun's forward graphs on an H100 (--arch 90; minutes)")
    opts = p.parse_args(argv)
    if opts.arch not in SHARED_LIMIT:
        p.error(f"--arch={opts.arch}: expected one of {', '.join(map(str, SHARED_LIMIT))} (compute capability x 10)")
    if opts.inductor and opts.arch != 90:
        p.error(f"--inductor: generates code for an H100 only (--arch 90), not --arch={opts.arch}")
    if opts.json and os.path.exists(opts.json):
        p.error(f"--json={opts.json}: already exists; give a new file path")
    if opts.json and not os.path.isdir(os.path.dirname(os.path.abspath(opts.json))):
        p.error(f"--json={opts.json}: its folder does not exist")
    report = compile_all(opts.arch, capture=not opts.no_capture, inductor=opts.inductor)
    text, bad = summarize(report)
    print(text)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(report, f, indent=1)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
