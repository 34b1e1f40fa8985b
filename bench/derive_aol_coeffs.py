"""Derive (a, b, c) tables for odd quintic orthogonalization steps, data-free.

The method is Polar Express's (Amsel, Persson, Musco, Gower 2025): a greedy
minimax composition. If every singular value of X lies in [l, u], step t picks
the odd quintic p(x) = a x + b x^3 + c x^5 minimizing max_{x in [l, u]} |1 - p(x)|.
A minimax p equioscillates: 1 - p takes its extreme value E with alternating sign
at four points l < q < r < u. Its image of [l, u] is therefore [1 - E, 1 + E]
with p(l) = 1 - E, so the next step works on [p(l), 2 - p(l)]. Repeat.

Two refinements make the composition robust in low precision, both as in Polar
Express:
- cushion: the minimax problem is solved on [max(l, cushion * u), u] instead of
  [l, u]. For tiny l the exact minimax quintic is nearly flat at 0 and gains
  little there; starting at cushion * u keeps the slope at 0 large. The result is
  then rescaled so that it is centred around 1 on the true interval, i.e.
  p(l) + p(u) = 2, and the next interval is again [p(l), 2 - p(l)].
- safety factor: on every step but the last, p(x) is replaced by p(x / safety),
  i.e. (a, b, c) / (safety, safety^3, safety^5), so that singular values pushed
  slightly above the bound by rounding are still mapped below the polynomial's
  growth region. The interval update uses the scaled polynomial.

With lower=1e-3, steps=5, safety=1.02, cushion=0.02 (and upper=1, which the 1.02 *
||X||_F normalization guarantees) this reproduces the published Polar Express 5
table to machine precision (tests/test_derive.py). After AOL preconditioning the
spectral norm is <= 1 by the Schur test, so upper=1 holds there as well; only the
lower bound differs, and it has to be measured on real momentum matrices.

Choosing the lower bound for AOL. After AOL scaling, real momentum matrices have a wide
spectrum (bench/momentum_samples.pt, step 150: max ~1.0, median ~6e-4, minimum ~3e-7). Four
steps cannot lift 1e-5 to 1: a schedule derived for the minimum ends with singular values
anywhere in [0.006, 2]. So --from-samples derives a schedule for each candidate lower bound
taken from the measured post-AOL spectrum (its minimum and its 0.1% ... 50% quantiles), scores
each by the RMS of p(sigma) - 1 over all measured singular values (exactly what the table does
to the spectrum, computed in fp64 on the scalars), and prints the best. That score is polar
accuracy, which did not decide loss: train_gpt.AOL_COEFFS is derive_schedule(1e-3, 4,
cap_final=True), the table that held level with Newton-Schulz in bench/ab.py's A/B, where the
best-scoring derive_schedule(3.2e-3, 4) was worse (bench/README.md, "A/B of optimizer options").

CLI:  python bench/derive_aol_coeffs.py --lower 1e-3 --steps 5
      python bench/derive_aol_coeffs.py --lower 1e-3 --steps 4 --cap-final     # train_gpt.AOL_COEFFS
      python bench/derive_aol_coeffs.py --from-samples bench/momentum_samples.pt --steps 4
"""

import math
import os
import sys

import numpy as np

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Above this l/u the minimax quintic is numerically its limit as l -> u, the
# Taylor-like quintic with p(u) = 1, p'(u) = p''(u) = 0; the 4x4 exchange system is
# too ill-conditioned to solve there.
NARROW_INTERVAL_RATIO = 1 - 5e-6


def _quintic(coeffs, x):
    a, b, c = coeffs
    return a * x + b * x**3 + c * x**5


def _interior_extrema(coeffs, lower, upper):
    """Points in (lower, upper) where p'(x) = a + 3b x^2 + 5c x^4 vanishes."""
    a, b, c = coeffs
    squares = np.roots([5 * c, 3 * b, a]) if c != 0 else np.roots([3 * b, a])
    points = [math.sqrt(y.real) for y in squares if abs(y.imag) < 1e-12 and y.real > 0]
    return sorted(x for x in points if lower < x < upper)


def minimax_quintic(lower: float, upper: float, tol: float = 1e-15, max_iter: int = 100):
    """Odd quintic minimizing max |1 - p(x)| over [lower, upper], by Remez exchange.

    Returns (a, b, c) and the equioscillation level E (> 0): 1 - p = +E, -E, +E, -E
    at the reference points lower < q < r < upper.
    """
    if not 0 < lower <= upper:
        raise ValueError(f"need 0 < lower <= upper, got [{lower}, {upper}]")
    if lower / upper >= NARROW_INTERVAL_RATIO:
        return (15 / 8 / upper, -10 / 8 / upper**3, 3 / 8 / upper**5), 0.0
    q, r = lower + (upper - lower) / 4, lower + 3 * (upper - lower) / 4
    level = None
    for _ in range(max_iter):
        reference = np.array([lower, q, r, upper])
        signs = np.array([1.0, -1.0, 1.0, -1.0])
        # Unknowns (a, b, c, E): p(x_i) + s_i E = 1 at the four reference points.
        system = np.stack([reference, reference**3, reference**5, signs], axis=1)
        a, b, c, new_level = np.linalg.solve(system, np.ones(4))
        coeffs = (a, b, c)
        extrema = _interior_extrema(coeffs, lower, upper)
        if len(extrema) != 2:
            raise RuntimeError(f"Remez lost the interior extrema on [{lower}, {upper}]: {extrema}")
        q, r = extrema
        converged = level is not None and abs(new_level - level) <= tol * max(1.0, abs(new_level))
        level = new_level
        if converged:
            break
    else:
        raise RuntimeError(f"Remez did not converge on [{lower}, {upper}]")
    return (float(a), float(b), float(c)), float(level)


def check_minimax(coeffs, level, lower, upper, grid_points: int = 200001, rel_tol: float = 1e-9):
    """Certify optimality (de la Vallee Poussin): the error alternates in sign with
    magnitude `level` on four points, and nowhere on [lower, upper] exceeds it. Then
    no odd quintic (3 free coefficients) can have a smaller maximum error."""
    if level == 0.0:
        return
    grid = np.concatenate([np.linspace(lower, upper, grid_points), np.geomspace(lower, upper, grid_points)])
    worst = np.max(np.abs(1 - _quintic(coeffs, grid)))
    if worst > level * (1 + rel_tol) + 1e-14:
        raise AssertionError(f"not minimax on [{lower}, {upper}]: max error {worst} > level {level}")
    q, r = _interior_extrema(coeffs, lower, upper)
    errors = 1 - _quintic(coeffs, np.array([lower, q, r, upper]))
    expected = level * np.array([1, -1, 1, -1])
    if not np.allclose(errors, expected, rtol=1e-6, atol=1e-12):
        raise AssertionError(f"no equioscillation on [{lower}, {upper}]: {errors} vs {expected}")


def derive_schedule(lower: float, steps: int, safety: float = 1.02, cushion: float = 0.02,
                    upper: float = 1.0, verify: bool = True, cap_final: bool = False):
    """Greedy minimax schedule of `steps` odd quintics for singular values in [lower, upper].

    cap_final: scale the last step so that its largest value on its interval is 1 (the minimax
    step otherwise ends in [1 - E, 1 + E], overshooting 1 by E): a safety margin on the output,
    which bf16 rounds and the update's size scales with. Returns a list of (a, b, c) tuples,
    one per step, in application order.
    """
    if not 0 < lower <= upper:
        raise ValueError(f"need 0 < lower <= upper, got [{lower}, {upper}]")
    schedule = []
    for step in range(steps):
        fit_lower = max(lower, cushion * upper)
        coeffs, level = minimax_quintic(fit_lower, upper)
        if verify:
            check_minimax(coeffs, level, fit_lower, upper)
        # Recentre on the true interval: with the cushion the fit ignored [lower, fit_lower).
        recentre = 2 / (_quintic(coeffs, lower) + _quintic(coeffs, upper))
        a, b, c = (recentre * v for v in coeffs)
        if step < steps - 1:
            a, b, c = a / safety, b / safety**3, c / safety**5
        elif cap_final:
            grid = np.concatenate([[lower, upper], _interior_extrema((a, b, c), lower, upper)])
            top = float(np.max(_quintic((a, b, c), grid)))
            a, b, c = a / top, b / top, c / top
        schedule.append((a, b, c))
        lower = _quintic((a, b, c), lower)
        upper = 2 - lower
    return schedule


def singular_value_interval(schedule, lower: float, upper: float = 1.0):
    """The exact image of [lower, upper] after each step: [(l_1, u_1), ...]. Each step's image
    is its quintic's minimum and maximum over the endpoints and the interior critical points,
    so it holds for any table, capped last step included (derive_schedule's own update,
    [p(l), 2 - p(l)], is the Polar Express rule it must keep to reproduce their table, and is
    looser: it assumes the interval's ends and extremes are symmetric about 1)."""
    bounds = []
    for coeffs in schedule:
        values = _quintic(coeffs, np.array([lower, upper, *_interior_extrema(coeffs, lower, upper)]))
        lower, upper = float(values.min()), float(values.max())
        bounds.append((lower, upper))
    return bounds


def aol_precondition(G):
    """diag(s) X as AOL's first step sees it (X = G on its wide orientation, train_gpt's
    _first_step_row_scale), in G's shape. All its singular values are <= 1; its smallest ones are
    what an AOL coefficient table has to lift to 1, so this is the matrix to measure when choosing
    the table."""
    if REPO_ROOT not in sys.path:
        sys.path.insert(0, REPO_ROOT)
    import train_gpt

    X, tall = train_gpt._as_wide_stack(G)
    s = train_gpt._first_step_row_scale("aol", X @ X.mT)
    X = (X.to(s.dtype) * s[:, :, None]).to(X.dtype)
    return (X.mT if tall else X).reshape(G.shape)


def post_aol_singular_values(path):
    """{name: fp64 singular values of each matrix after AOL scaling} for a samples file."""
    import torch

    samples = torch.load(path, map_location="cpu")
    return {name: torch.linalg.svdvals(aol_precondition(stack.double())).numpy()
            for name, stack in samples.items()}


CANDIDATE_QUANTILES = (0.0, 0.001, 0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5)


def spectrum_rms_error(schedule, singular_values):
    """RMS of p(sigma) - 1 over the given singular values, p the composed schedule."""
    x = np.asarray(singular_values, dtype=np.float64)
    for coeffs in schedule:
        x = _quintic(coeffs, x)
    return float(np.sqrt(np.mean((x - 1) ** 2)))


def lower_bound_from_spectrum(singular_values, steps, safety=1.02, cushion=0.02, cap_final=False):
    """[(quantile, lower, rms error)] for each candidate and the best lower bound."""
    sweep = []
    for q in CANDIDATE_QUANTILES:
        lower = float(np.quantile(singular_values, q))
        schedule = derive_schedule(lower, steps, safety, cushion, cap_final=cap_final)
        sweep.append((q, lower, spectrum_rms_error(schedule, singular_values)))
    best = min(sweep, key=lambda row: row[2])
    return sweep, best[1]


def main():
    sys.path.insert(0, REPO_ROOT)
    from data.cli_util import OneLineArgumentParser, positive_float, positive_int

    parser = OneLineArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lower", type=positive_float, default=1e-3, help="smallest singular value to map near 1")
    parser.add_argument("--from-samples", metavar="PATH",
                        help="take --lower from the post-AOL spectrum of these momentum matrices: the quantile whose table fits it best")
    parser.add_argument("--steps", type=positive_int, default=5)
    parser.add_argument("--upper", type=positive_float, default=1.0, help="largest singular value before the first step")
    parser.add_argument("--safety", type=positive_float, default=1.02)
    parser.add_argument("--cushion", type=positive_float, default=0.02)
    parser.add_argument("--cap-final", action="store_true",
                        help="scale the last step so that its largest value is 1, not 1 + E (train_gpt.AOL_COEFFS is "
                             "--lower 1e-3 --steps 4 --cap-final)")
    parser.add_argument("--name", default="AOL_COEFFS", help="name of the printed Python constant")
    args = parser.parse_args()
    if args.lower > args.upper:
        parser.error(f"--lower {args.lower} is above --upper {args.upper}")
    if args.from_samples and not os.path.isfile(args.from_samples):
        parser.error(f"--from-samples {args.from_samples}: no such file (bench/capture_momentum.py writes it)")
    if args.from_samples:
        spectra = []
        for name, values in post_aol_singular_values(args.from_samples).items():
            for i, sv in enumerate(values):
                print(f"# {name}[{i}] after AOL: min {sv.min():.3g}, 1st percentile {np.quantile(sv, 0.01):.3g}, "
                      f"median {np.median(sv):.3g}, max {sv.max():.3g}")
                spectra.append(sv)
        sweep, args.lower = lower_bound_from_spectrum(np.concatenate(spectra), args.steps, args.safety, args.cushion,
                                                      args.cap_final)
        for q, lower, error in sweep:
            print(f"# lower = {q:.1%} quantile = {lower:.3g}: RMS |p(sigma) - 1| over the samples {error:.4f}")
    schedule = derive_schedule(args.lower, args.steps, args.safety, args.cushion, args.upper, cap_final=args.cap_final)
    bounds = singular_value_interval(schedule, args.lower, args.upper)
    print(f"# derive_schedule(lower={args.lower}, steps={args.steps}, safety={args.safety}, "
          f"cushion={args.cushion}, upper={args.upper}{', cap_final=True' if args.cap_final else ''})")
    print(f"{args.name} = [")
    for (a, b, c), (lo, hi) in zip(schedule, bounds):
        print(f"    ({a!r}, {b!r}, {c!r}),  # singular values then in [{lo:.4g}, {hi:.4g}]")
    print("]")


if __name__ == "__main__":
    main()
