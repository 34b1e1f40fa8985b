"""Search AOL schedules: fit on some momentum captures, score on held-out ones.

After AOL's row scaling every singular value of diag(s) G lies in (0, 1]; a table of T odd
quintics then has to map them near 1. The candidates, for T = 3, 4 and 5 steps:
- greedy minimax tables (Polar Express's construction, bench/derive_aol_coeffs.py) for [l, 1],
  with l a quantile of the post-AOL spectrum of the *fit* captures or a fixed l (the
  data-free Polar Express tables for [l, 1]), each plain and with the last step capped at 1
  (cap_final: no overshoot, the safety margin on the last step);
- the tables public Turbo-Muon code runs after AOL (Polar Express steps 2-5, the Dion set),
  the Newton-Schulz quintic (AOL + NS4, AOL + NS3), and train_gpt.AOL_COEFFS as it is now.
Frobenius-normalized NS5 and PE5 are scored beside them. Every candidate is run on the
*held-out* captures (other training steps than the fit ones) in emulated bf16 with
bench/orthogonalize.py's metrics: polar error, cosine to the polar factor, singular values of
the output, and its RMS relative to the polar factor's. FLOPs: T/5 of NS5 (or PE5) on the
same symmetric kernels, since AOL's scaling reuses the first Gram.

Prints one row per candidate (best first within each step count), the best per step count
with its --ns_coeffs string and the muon_lr that gives it NS5's update RMS (the learning-rate
control for bench/ab.py), and writes the same as JSON to --out.

Usage: python bench/aol_search.py [--samples bench/momentum_samples.pt] [--fit s150] [--out FILE]
"""

import json
import os
import sys
import time

import numpy as np
import torch

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import train_gpt as ns  # noqa: E402
from bench import derive_aol_coeffs  # noqa: E402
from bench.derive_aol_coeffs import derive_schedule  # noqa: E402
from bench.orthogonalize import DEFAULT_SAMPLES, DION_AOL_COEFFS, accuracy, polar_factor, singular_values  # noqa: E402
from data.cli_util import OneLineArgumentParser, positive_float  # noqa: E402

QUANTILES = (0.001, 0.01, 0.05, 0.1, 0.2, 0.3, 0.5)
FIXED_LOWER = (1e-3, 1e-2, 3e-2, 0.1)
STEPS = (3, 4, 5)


def split_captures(samples, fit_prefix):
    """{name: stack} -> (fit, held_out) lists of (name, fp32 stack); names look like s150/768x768."""
    fit = [(name, stack.float()) for name, stack in samples.items() if name.split("/")[0] == fit_prefix]
    held_out = [(name, stack.float()) for name, stack in samples.items() if name.split("/")[0] != fit_prefix]
    return fit, held_out


def post_aol_spectrum(stacks):
    """All singular values of diag(s) G over the given stacks (bf16 inputs, fp64 maths)."""
    return torch.cat([singular_values(derive_aol_coeffs.aol_precondition(stack.to(torch.bfloat16).double()))
                      for _, stack in stacks]).numpy()


def coeffs_flag(coeffs):
    return ";".join(",".join(repr(float(v)) for v in step) for step in coeffs)  # exact: repr round-trips


def candidates(fit_spectrum):
    """(label, method, coeffs, info) for every table the search scores."""
    rows = [("NS5", "newton_schulz", ns.NEWTON_SCHULZ_COEFFS, dict(kind="reference")),
            ("PE5", "polar_express", ns.POLAR_EXPRESS_COEFFS, dict(kind="reference")),
            ("AOL+AOL_COEFFS(now)", "aol", ns.AOL_COEFFS, dict(kind="current")),
            ("AOL+PE(2-5)", "aol", ns.POLAR_EXPRESS_COEFFS[1:], dict(kind="public")),
            ("AOL+Dion", "aol", DION_AOL_COEFFS, dict(kind="public")),
            ("AOL+NS4", "aol", ns.NEWTON_SCHULZ_COEFFS[:4], dict(kind="newton_schulz")),
            ("AOL+NS3", "aol", ns.NEWTON_SCHULZ_COEFFS[:3], dict(kind="newton_schulz"))]
    lowers = [(f"q{q:g}", float(np.quantile(fit_spectrum, q))) for q in QUANTILES]
    lowers += [(f"l{lower:g}", lower) for lower in FIXED_LOWER]
    for steps in STEPS:
        for name, lower in lowers:
            for cap in (False, True):
                label = f"AOL{steps}-{name}" + ("-cap" if cap else "")
                rows.append((label, "aol", derive_schedule(lower, steps, cap_final=cap),
                             dict(kind="derived", lower=lower, cap_final=cap, lower_from=name)))
    return rows


def score(rows, held_out):
    """Held-out metrics per candidate, means over every held-out matrix."""
    references = [(stack, polar_factor(stack.to(torch.bfloat16))) for _, stack in held_out]
    results = []
    for label, method, coeffs, info in rows:
        metrics = {"error": [], "cosine": [], "rms": []}
        values = []
        for stack, reference in references:
            per_matrix, sv = accuracy(stack, reference, method, coeffs)
            for key in metrics:
                metrics[key] += per_matrix[key].tolist()
            values.append(sv)
        sv = torch.cat(values)
        results.append(dict(label=label, method=method, steps=len(coeffs), coeffs=[list(c) for c in coeffs],
                            flops_vs_ns5=len(coeffs) / 5, polar_error=float(np.mean(metrics["error"])),
                            cosine=float(np.mean(metrics["cosine"])), rms=float(np.mean(metrics["rms"])),
                            sv_min=sv.min().item(), sv_median=sv.median().item(), sv_max=sv.max().item(), **info))
        print(f"  scored {label}", file=sys.stderr, flush=True)
    return results


def main():
    parser = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", default=DEFAULT_SAMPLES)
    parser.add_argument("--fit", default=None, help="capture step prefix to fit on (default: the middle one)")
    parser.add_argument("--muon-lr", type=positive_float, default=0.05, help="the lr the matched-RMS lr is scaled from")
    parser.add_argument("--out", default=None, help="also write the results as JSON here")
    args = parser.parse_args()
    if not os.path.isfile(args.samples):
        parser.error(f"--samples {args.samples}: no such file (bench/capture_momentum.py writes it)")
    samples = torch.load(args.samples, map_location="cpu")
    prefixes = sorted({name.split("/")[0] for name in samples}, key=lambda p: int(p.lstrip("s") or 0))
    if len(prefixes) < 2:
        parser.error(f"--samples {args.samples}: needs captures from at least two steps (names s<step>/<shape>)")
    fit_prefix = args.fit or prefixes[len(prefixes) // 2]
    if fit_prefix not in prefixes:
        parser.error(f"--fit {fit_prefix}: not among the captured steps {', '.join(prefixes)}")
    torch.set_num_threads(ns.usable_cpus())
    started = time.time()
    fit, held_out = split_captures(samples, fit_prefix)
    fit_spectrum = post_aol_spectrum(fit)
    print(f"fit on {', '.join(n for n, _ in fit)} ({fit_spectrum.size} post-AOL singular values: min "
          f"{fit_spectrum.min():.3g}, 10% {np.quantile(fit_spectrum, 0.1):.3g}, median {np.median(fit_spectrum):.3g}, "
          f"max {fit_spectrum.max():.3g}); held out: {', '.join(n for n, _ in held_out)}")
    results = score(candidates(fit_spectrum), held_out)
    ns5_rms = next(r["rms"] for r in results if r["label"] == "NS5")
    for r in results:
        r["matched_muon_lr"] = args.muon_lr * ns5_rms / r["rms"]
        r["ns_coeffs"] = coeffs_flag(r["coeffs"])

    print(f"\n{'candidate':<24} {'steps':>5} {'FLOPs':>5} {'polar_err':>9} {'cos':>6} {'sv_min':>7} {'sv_med':>7} "
          f"{'sv_max':>7} {'rms':>6} {'lr@NS5 rms':>10}")
    order = sorted(results, key=lambda r: (r["kind"] != "reference", r["steps"], r["polar_error"]))
    for r in order:
        print(f"{r['label']:<24} {r['steps']:>5} {r['flops_vs_ns5']:>5.2f} {r['polar_error']:>9.4f} {r['cosine']:>6.3f} "
              f"{r['sv_min']:>7.3f} {r['sv_median']:>7.3f} {r['sv_max']:>7.3f} {r['rms']:>6.3f} "
              f"{r['matched_muon_lr']:>10.4f}")
    print("\nbest AOL table per step count (held-out polar error):")
    best = {}
    for steps in STEPS:
        pool = [r for r in results if r["method"] == "aol" and r["steps"] == steps]
        if pool:
            best[steps] = min(pool, key=lambda r: r["polar_error"])
            r = best[steps]
            print(f"  {steps} steps: {r['label']} polar error {r['polar_error']:.4f}, cos {r['cosine']:.3f}, "
                  f"rms {r['rms']:.3f}; --ns_method aol --ns_coeffs \"{r['ns_coeffs']}\" "
                  f"(NS5's RMS at --muon_lr {r['matched_muon_lr']:.4f})")
    print(f"({time.time() - started:.0f} s)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(fit=fit_prefix, held_out=[n for n, _ in held_out], results=results,
                           best={str(k): v["label"] for k, v in best.items()}), f, indent=1)


if __name__ == "__main__":
    main()
