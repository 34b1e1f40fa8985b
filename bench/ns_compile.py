"""The orthogonalizer eager against compiled whole, as the trainer runs it with and without --compile.

For each ns_method and each of one rank's Muon stacks of the speedrun (at --world-sizes), prints
ms per call (median, triton.testing.do_bench) of
- the Triton kernels eagerly (what the trainer ran with --compile before 2026-11-26),
- the Triton kernels compiled whole, `torch.compile(orthogonalize, dynamic=False, fullgraph=True)`
  (what ShardedMuonAdam.compile_orthogonalizer runs under --compile, the default),
- the PyTorch twin compiled the same way (the orthogonalizer of --ns_backend torch),
and each one's relative Frobenius error against an fp64 run of the same bf16 input, with the bound
bench/gpu_proof.py holds the kernels to (1.5x the eager PyTorch twin's error + 1e-3), and whether
compiled and eager Triton agree bit for bit (the kernels are the same; the scaling around them
is fused by the compiler, so rounding may differ). CUDA only.

Usage: python bench/ns_compile.py [--world-sizes 1,8] [--methods newton_schulz,polar_express,aol]
"""

import os
import sys
import warnings

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import train_gpt  # noqa: E402
from bench.gpu_proof import muon_layout, rel_err, time_call, twin_bound  # noqa: E402
from data.cli_util import OneLineArgumentParser  # noqa: E402


def main(argv=None):
    p = OneLineArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--world-sizes", default="1,8", help="comma-separated: 1 and/or 8 (one rank's stacks)")
    p.add_argument("--methods", default=",".join(train_gpt.NS_METHODS), help="comma-separated ns_methods")
    opts = p.parse_args(argv)
    worlds = opts.world_sizes.split(",")
    if not worlds or any(w not in ("1", "8") for w in worlds):
        p.error(f"--world-sizes={opts.world_sizes!r}: expected 1, 8 or 1,8")
    methods = opts.methods.split(",")
    for m in methods:
        if m not in train_gpt.NS_METHODS:
            p.error(f"--methods={opts.methods!r}: {m!r} is none of {', '.join(train_gpt.NS_METHODS)}")
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (Triton kernels in bf16); on CPU tests/test_ns.py checks the kernels")
    # inductor 2.11 warns about its own use of a deprecated helper at every compilation (seen on an H100)
    warnings.filterwarnings("ignore", message=".*torch._prims_common.check", category=FutureWarning)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    compiled = torch.compile(train_gpt.orthogonalize, dynamic=False, fullgraph=True)
    layout = muon_layout(train_gpt, torch)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; error: relative Frobenius against fp64; "
          f"bound: 1.5 x the eager PyTorch twin's + 1e-3")
    print(f"{'GPUs':>4} {'stack':>15} {'ns_method':14} {'eager triton':>12} {'compiled':>9} {'compiled torch':>14}"
          f"   {'err eager':>9} {'err comp':>9} {'bound':>7}  same bits")
    torch.manual_seed(0)
    for world in map(int, worlds):
        for (m, n), count in sorted(layout["per_rank"][world].items(), key=lambda kv: -kv[0][0] * kv[0][1]):
            G = torch.randn(count, m, n, device="cuda").bfloat16()
            for method in methods:
                ref = train_gpt.orthogonalize_torch(G.double(), method)
                twin = train_gpt.orthogonalize_torch(G, method)
                eager_out = train_gpt.orthogonalize(G, method, "triton")
                compiled_out = compiled(G, method, "triton")
                ms = [time_call(torch, True, lambda: train_gpt.orthogonalize(G, method, "triton")),
                      time_call(torch, True, lambda: compiled(G, method, "triton")),
                      time_call(torch, True, lambda: compiled(G, method, "torch"))]
                errors = [rel_err(eager_out, ref), rel_err(compiled_out, ref)]
                bound = twin_bound(rel_err(twin, ref), "bfloat16")
                print(f"{world:>4} {f'{count} x {m}x{n}':>15} {method:14} {ms[0]:12.3f} {ms[1]:9.3f} {ms[2]:14.3f}"
                      f"   {errors[0]:9.2e} {errors[1]:9.2e} {bound:7.1e}  {torch.equal(eager_out, compiled_out)}"
                      + ("" if max(errors) <= bound else "   OVER THE BOUND"), flush=True)


if __name__ == "__main__":
    main()
