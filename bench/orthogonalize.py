"""Compare the orthogonalizers: polar error, cosine, singular values, update size, GEMM FLOPs, speed.

For every variant (NS5, PE5, AOL + four Newton-Schulz steps, AOL + Polar Express steps
2-5, AOL + the Dion/You table, AOL + train_gpt.AOL_COEFFS or a derived table) and every
input set, prints
- polar error ||f(G) - U V^T||_F / ||U V^T||_F against an fp64 SVD of G (mean over
  the matrices of the set),
- cos: the cosine between f(G) and U V^T (Frobenius inner product; 1 = same direction,
  whatever the size), mean over the set,
- min / median / max singular value of f(G) over the set,
- rms: the update's RMS relative to the exact polar factor's, ||f(G)||_F / ||U V^T||_F
  (what the learning rate multiplies; 1 for an exact polar factor),
- a row "(AOL scaling, exact)" per input: the polar error of the exact polar factor
  of diag(s) G (AOL's floor: it converges to that, not to polar(G)) and the singular
  values of diag(s) G, the range an AOL table has to map to 1,
- GEMM FLOPs per matrix, dense and with the symmetric kernels,
- on CUDA only: ms per call and TFLOP/s of the Triton kernels and of the PyTorch
  twin, bf16, on a stack of --gpu-batch matrices (TFLOP/s counts the FLOPs each
  backend actually performs: symmetric for Triton, dense for the twin).
Input sets: real momentum matrices from bench/momentum_samples.pt when it exists
(a dict name -> tensor (B, m, n), written by the trainer), and Gaussian matrices of
the speedrun's shapes.

Accuracy runs use the PyTorch twin with bf16 emulated on CPU: inputs rounded to bf16,
fp32 GEMMs whose every output is rounded through bf16 (orthogonalize_torch's
round_through). Products of bf16 numbers are exact in fp32, so this is what bf16
GEMMs with fp32 accumulation compute on GPU, up to summation order; it runs ~100x
faster than CPU bf16 matmuls and matches them to 3 digits of polar error.

Usage: python bench/orthogonalize.py [--quick] [--aol-lower 0.05] [--samples PATH]
"""

import os
import sys
import time

import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import train_gpt as ns  # noqa: E402
from bench import derive_aol_coeffs  # noqa: E402
from bench.derive_aol_coeffs import derive_schedule  # noqa: E402
from bench.gpu_proof import orthogonalize_flops  # noqa: E402
from data.cli_util import OneLineArgumentParser, positive_float, positive_int  # noqa: E402

# Coefficients run after AOL in public Turbo-Muon code (Dion / You Jiacheng).
DION_AOL_COEFFS = [
    (3.9505, -6.3029, 2.6377),
    (3.7418, -5.5913, 2.3037),
    (2.8769, -3.1427, 1.2046),
    (2.8366, -3.0525, 1.2012),
]
SHAPES = [(768, 768), (768, 3072), (3072, 768)]
DEFAULT_SAMPLES = os.path.join(REPO_ROOT, "bench", "momentum_samples.pt")


def variants(aol_table, aol_label):
    """(label, method, coeffs) rows; the last one is the AOL schedule under evaluation."""
    return [
        ("NS5", "newton_schulz", ns.NEWTON_SCHULZ_COEFFS),
        ("PE5", "polar_express", ns.POLAR_EXPRESS_COEFFS),
        ("AOL+NS4", "aol", ns.NEWTON_SCHULZ_COEFFS[:4]),
        ("AOL+PE(2-5)", "aol", ns.POLAR_EXPRESS_COEFFS[1:]),
        ("AOL+Dion", "aol", DION_AOL_COEFFS),
        (aol_label, "aol", aol_table),
    ]


def polar_factor(G: torch.Tensor) -> torch.Tensor:
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    return U @ Vh


def singular_values(O: torch.Tensor) -> torch.Tensor:
    """All singular values of a stack, from the eigenvalues of the small-side Gram (fp64)."""
    O = O.double()
    gram = O @ O.mT if O.size(-2) <= O.size(-1) else O.mT @ O
    return torch.linalg.eigvalsh(gram).clamp_min(0).sqrt().flatten()


def aol_row(stack: torch.Tensor, reference: torch.Tensor) -> str:
    """What any AOL table works with, computed exactly (fp64) from the bf16 input:
    polar error column: the error of the exact polar factor of diag(s) G. AOL converges
    to that, not to polar(G), so no table can do better (its floor).
    singular value columns: min / median / max of diag(s) G, the range the table must
    map to 1, plus the median of the per-matrix minima."""
    scaled = derive_aol_coeffs.aol_precondition(stack.to(torch.bfloat16).double())
    floor = (polar_factor(scaled) - reference).norm(dim=(-2, -1)) / reference.norm(dim=(-2, -1))
    per_matrix = [singular_values(matrix) for matrix in scaled]
    everything = torch.cat(per_matrix)
    minima = torch.stack([sv.min() for sv in per_matrix])
    return f"{floor.mean().item():9.4f} {everything.min().item():7.3f} {everything.median().item():7.3f} " \
           f"{everything.max().item():7.3f}   (median per-matrix min {minima.median().item():.3g})"


def emulated_bf16(G: torch.Tensor, method: str, coeffs) -> torch.Tensor:
    X = G.to(torch.bfloat16).float()
    return ns.orthogonalize_torch(X, method, coeffs, round_through=torch.bfloat16)


def accuracy(stack: torch.Tensor, reference: torch.Tensor, method: str, coeffs):
    """Per matrix: polar error, cosine to the polar factor, RMS relative to it; and all singular values."""
    out = emulated_bf16(stack, method, coeffs).double()
    ref_norm = reference.norm(dim=(-2, -1))
    errors = (out - reference).norm(dim=(-2, -1)) / ref_norm
    out_norm = out.norm(dim=(-2, -1))
    cosine = (out * reference).sum(dim=(-2, -1)) / (out_norm * ref_norm).clamp_min(1e-300)
    return dict(error=errors, cosine=cosine, rms=out_norm / ref_norm), singular_values(out)


def cuda_timing(shape, batch, method, coeffs, backend, warmup=3, iters=10):
    G = torch.randn(batch, *shape, device="cuda", dtype=torch.bfloat16)
    run = ns.orthogonalize_triton if backend == "triton" else ns.orthogonalize_torch
    for _ in range(warmup):  # includes Triton autotuning on the first call
        run(G, method, coeffs)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        run(G, method, coeffs)
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / iters
    flops = batch * orthogonalize_flops(*shape, len(coeffs), symmetric=backend == "triton")
    return ms, flops / (ms * 1e-3) / 1e12


def speed_columns(shape, gpu_batch, method, coeffs):
    if not torch.cuda.is_available():
        return "n/a (no CUDA)"
    cells = []
    for backend in ("triton", "torch"):
        ms, tflops = cuda_timing(shape, gpu_batch, method, coeffs, backend)
        cells.append(f"{ms:9.3f} {tflops:7.1f}")
    return "  ".join(cells)


def report_set(title, matrices, rows, gpu_batch, show_speed):
    """Print one table; returns {label: (mean polar error, GEMM FLOPs relative to PE5's, same kernels)}."""
    print(f"\n== {title} ==")
    header = f"{'matrices':>16} {'variant':<22} {'polar_err':>9} {'sv_min':>7} {'sv_med':>7} {'sv_max':>7} " \
             f"{'cos':>6} {'rms':>6} {'GF dense':>8} {'GF sym':>7}"
    if show_speed:
        header += "   ms triton TFLOP/s   ms torch TFLOP/s"
    print(header)
    totals = {label: [0.0, 0.0, 0] for label, _, _ in rows}  # error sum, sym FLOPs, matrices
    pe5_flops = 0.0  # on the same symmetric kernels, as every method runs in the trainer
    for name, stack in matrices:
        stack = stack.float()
        reference = polar_factor(stack.to(torch.bfloat16))
        print(f"{name:>16} {'(AOL scaling, exact)':<22} " + aol_row(stack, reference))
        m, n = stack.shape[-2:]
        pe5_flops += stack.shape[0] * orthogonalize_flops(m, n, len(ns.POLAR_EXPRESS_COEFFS), symmetric=True)
        for label, method, coeffs in rows:
            metrics, sv = accuracy(stack, reference, method, coeffs)
            dense = orthogonalize_flops(m, n, len(coeffs), symmetric=False)
            sym = orthogonalize_flops(m, n, len(coeffs), symmetric=True)
            line = f"{name:>16} {label:<22} {metrics['error'].mean().item():9.4f} {sv.min().item():7.3f} " \
                   f"{sv.median().item():7.3f} {sv.max().item():7.3f} {metrics['cosine'].mean().item():6.3f} " \
                   f"{metrics['rms'].mean().item():6.3f} {dense / 1e9:8.2f} {sym / 1e9:7.2f}"
            if show_speed:
                line += "   " + speed_columns((m, n), gpu_batch, method, coeffs)
            print(line, flush=True)
            totals[label][0] += metrics["error"].sum().item()
            totals[label][1] += stack.shape[0] * sym
            totals[label][2] += stack.shape[0]
    return {label: (err / count, sym / pe5_flops) for label, (err, sym, count) in totals.items()}


def load_momentum_samples(path, max_per_name):
    if not os.path.exists(path):
        print(f"\n(no momentum samples at {path}: real-matrix part skipped; the trainer writes that file)")
        return None
    samples = torch.load(path, map_location="cpu")
    matrices = []
    for name, stack in samples.items():
        stack = stack.reshape(-1, *stack.shape[-2:])[:max_per_name]
        matrices.append((f"{name}", stack))
    return matrices


def main():
    parser = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="one matrix per shape / sample name")
    parser.add_argument("--batch", type=positive_int, default=4, help="Gaussian matrices per shape (accuracy)")
    parser.add_argument("--gpu-batch", type=positive_int, default=12, help="stack size for CUDA timings")
    parser.add_argument("--max-per-name", type=positive_int, default=4, help="momentum matrices used per sample name")
    parser.add_argument("--samples", default=DEFAULT_SAMPLES)
    parser.add_argument("--aol-lower", type=positive_float, default=None,
                        help="derive the AOL table for singular values in [L, 1] (default: train_gpt.AOL_COEFFS)")
    parser.add_argument("--aol-steps", type=positive_int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.quick:
        args.batch, args.max_per_name = 1, 1
    torch.manual_seed(args.seed)
    torch.set_num_threads(ns.usable_cpus())

    if args.aol_lower is None:
        aol_table, aol_label = ns.AOL_COEFFS, "AOL+AOL_COEFFS"
    else:
        aol_table = derive_schedule(args.aol_lower, args.aol_steps)
        aol_label = f"AOL+derived(l={args.aol_lower:g})"
    rows = variants(aol_table, aol_label)
    started = time.time()
    print(f"device: {'cuda ' + torch.cuda.get_device_name() if torch.cuda.is_available() else 'cpu'}; "
          f"accuracy in emulated bf16 (fp32 GEMMs rounded through bf16), reference fp64 SVD")

    summary, summary_set = None, None
    momentum = load_momentum_samples(args.samples, args.max_per_name)
    if momentum:
        summary = report_set("real momentum matrices", momentum, rows, args.gpu_batch, show_speed=False)
        summary_set = "real momentum matrices"
    gaussian = [(f"{m}x{n}", torch.randn(args.batch, m, n)) for m, n in SHAPES]
    gaussian_summary = report_set(f"Gaussian matrices, {args.batch} per shape", gaussian, rows, args.gpu_batch,
                                  show_speed=True)
    if summary is None:
        summary, summary_set = gaussian_summary, "Gaussian matrices (no momentum samples)"
    print(f"\n({time.time() - started:.0f} s)")
    pe5_error = summary["PE5"][0]
    aol_error, aol_flop_ratio = summary[aol_label]
    print(f"{aol_label}: polar error {aol_error:.4f} = {aol_error / pe5_error:.2f}x PE5's {pe5_error:.4f} "
          f"on {summary_set}; GEMM FLOPs {aol_flop_ratio:.1%} of PE5's (or NS5's) on the same kernels")


if __name__ == "__main__":
    main()
