"""Reproduce published polar errors of orthogonalizers on Gaussian 768x3072 matrices.

The figures this project was given (its fact sheet, ../shared/SPEEDRUN_FACTS.md, which is not
part of the repository): NS5 0.162, PE5 0.096, AOL+PE(2-5) 0.096, AOL+Dion(2-5) 0.018, measured in
fp64 and in emulated bf16. Prints both precisions next to the quoted values.
Takes about 10 s for the default 2 matrices on a 2-core CPU (2026-11-25; the fp64 SVD dominates).

Usage: python bench/polar_error_facts.py [--batch 2] [--seed 0]
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import train_gpt as ns  # noqa: E402
from data.cli_util import OneLineArgumentParser, positive_int  # noqa: E402
from bench.orthogonalize import DION_AOL_COEFFS, emulated_bf16, polar_factor  # noqa: E402

QUOTED = [
    ("NS5", "newton_schulz", ns.NEWTON_SCHULZ_COEFFS, 0.162),
    ("PE5", "polar_express", ns.POLAR_EXPRESS_COEFFS, 0.096),
    ("AOL+PE(2-5)", "aol", ns.POLAR_EXPRESS_COEFFS[1:], 0.096),
    ("AOL+Dion(2-5)", "aol", DION_AOL_COEFFS, 0.018),
]


def relative_error(out, reference):
    return ((out.double() - reference).norm(dim=(-2, -1)) / reference.norm(dim=(-2, -1))).mean().item()


def main():
    parser = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=positive_int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    G = torch.randn(args.batch, 768, 3072, dtype=torch.float64)
    reference = polar_factor(G)
    print(f"Gaussian 768x3072, {args.batch} matrices; polar error vs fp64 SVD")
    print(f"{'variant':<15} {'fp64':>7} {'bf16 emu':>8} {'quoted':>7}")
    for label, method, coeffs, quoted in QUOTED:
        fp64 = relative_error(ns.orthogonalize_torch(G, method, coeffs), reference)
        bf16 = relative_error(emulated_bf16(G.float(), method, coeffs), reference)
        print(f"{label:<15} {fp64:7.4f} {bf16:8.4f} {quoted:7.3f}", flush=True)


if __name__ == "__main__":
    main()
