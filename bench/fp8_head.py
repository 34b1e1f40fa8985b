"""Speed of the FP8 head's two custom-op bodies, eager against compiled, on one micro-batch.

The head multiplies the (tokens x 768) block output by the (50304 x 768) head weight in float8.
Its backward rounds the (tokens x 50304) logit gradient to float8 and needs it both row-major and
transposed: eager, that transposed copy of a 2.5 GB float8 tensor runs through PyTorch's generic
strided-copy kernel; compiled, scaling, rounding and the copy are one fused pass. This script
times `_fp8_mm_forward` and `_fp8_mm_backward` of train_gpt.py eager and `torch.compile`d (what
the custom ops run on CUDA) and prints ms per call (CUDA events), host ms per call (time until the
call returns: a host sync shows up here), whether the compiled outputs equal the eager ones bit
for bit, and their strides (the ops' fake functions promise row-major outputs; tests/test_model.py
checks the fakes against the real ops on CPU). They are not equal: eager
rounds x / scale to bfloat16 before the float8 cast, compiled code casts the fp32 quotient
(tests/test_model.py bounds both against full precision). Two more rows time the backward's
weight-gradient GEMM alone, with its transposed copies: ours, g^T x, and the record's orientation,
(x^T g)^T, "faster than g^T x" for (50304, 768) by the record's comment. Its result is
column-major (the trainer's op promises row-major, like the weight, so switching would change its
fake too). CUDA only.

Usage: python bench/fp8_head.py [--tokens 49152] [--iters 10]
"""

import functools
import os
import sys
import time

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import train_gpt  # noqa: E402
from data.cli_util import OneLineArgumentParser, positive_int  # noqa: E402


def time_calls(fn, iters):
    """(GPU ms, host ms) per call, after three warm-up calls; returns the last result too."""
    for _ in range(3):
        result = fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(iters):
        result = fn()
    end.record()
    host_ms = (time.perf_counter() - t0) * 1e3 / iters
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters, host_ms, result


def weight_gradient(g8, x8, x_scale, grad_scale):
    """The backward's weight gradient as train_gpt.py computes it, g^T x: row-major like the weight."""
    scale = functools.partial(g8.new_tensor, dtype=torch.float32)
    return (torch._scaled_mm(g8.T.contiguous(), x8.T.contiguous().T, out_dtype=torch.float32,
                             scale_a=scale(grad_scale), scale_b=scale(x_scale), use_fast_accum=False),)


def weight_gradient_as_the_record(g8, x8, x_scale, grad_scale):
    """The record's form, (x^T g)^T ("faster than grad_f8_t @ x_f8" by its comment): column-major."""
    scale = functools.partial(g8.new_tensor, dtype=torch.float32)
    return (torch._scaled_mm(x8.T.contiguous(), g8.T.contiguous().T, out_dtype=torch.float32,
                             scale_a=scale(x_scale), scale_b=scale(grad_scale), use_fast_accum=False).T,)


def main(argv=None):
    p = OneLineArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=positive_int, default=49152, help="rows of one micro-batch (speedrun: 48Ki)")
    p.add_argument("--iters", type=positive_int, default=10, help="timed calls per variant")
    opts = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU (float8 matmuls); on CPU the bodies run eagerly and tests/test_model.py checks them")
    args = train_gpt.Hyperparameters()
    T, D, V = opts.tokens, args.model_dim, args.vocab_size
    x_scale, w_scale, grad_scale = train_gpt.fp8_head_scales(D)
    torch.manual_seed(0)
    x = train_gpt.rms_norm(torch.randn(T, D, device="cuda")).bfloat16()
    w = torch.randn(V, D, device="cuda") * 0.02
    grad = (torch.rand(T, V, device="cuda") * 2 - 1).bfloat16()  # a soft-capped logit's gradient is in [-1, 1]
    _, x8, w8 = train_gpt._fp8_mm_forward(x, w, x_scale, w_scale)
    g8 = grad.div(grad_scale).to(torch.float8_e5m2)
    calls = {
        "forward": (train_gpt._fp8_mm_forward, (x, w, x_scale, w_scale)),
        "backward": (train_gpt._fp8_mm_backward, (grad, x8, w8, x_scale, w_scale, grad_scale)),
        "its grad_w, ours": (weight_gradient, (g8, x8, x_scale, grad_scale)),
        "its grad_w, the record's": (weight_gradient_as_the_record, (g8, x8, x_scale, grad_scale)),
    }
    print(f"FP8 head, {T} tokens x {D} -> {V}, {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'body':26} {'form':9} {'GPU ms':>8} {'host ms':>8}  outputs equal to eager  strides")
    for name, (fn, inputs) in calls.items():
        eager_gpu, eager_host, eager_out = time_calls(lambda: fn(*inputs), opts.iters)
        comp = train_gpt._compiled(fn)
        comp_gpu, comp_host, comp_out = time_calls(lambda: comp(*inputs), opts.iters)
        same = all(torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a, b.view(torch.uint8)
                               if b.dtype.itemsize == 1 else b) for a, b in zip(eager_out, comp_out))
        strides = [tuple(t.stride()) for t in comp_out]
        print(f"{name:26} {'eager':9} {eager_gpu:8.3f} {eager_host:8.3f}")
        print(f"{name:26} {'compiled':9} {comp_gpu:8.3f} {comp_host:8.3f}  {str(same):22}  {strides}")
        if [tuple(t.stride()) for t in eager_out] != strides:
            print(f"{name}: compiled strides differ from eager {[tuple(t.stride()) for t in eager_out]}")


if __name__ == "__main__":
    main()
