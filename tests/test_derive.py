"""The coefficient generator reproduces Polar Express and produces minimax quintics."""
import os
import sys

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from scipy.optimize import linprog  # noqa: E402

from bench.derive_aol_coeffs import (  # noqa: E402
    check_minimax, derive_schedule, minimax_quintic, singular_value_interval,
)

# Published table (Amsel et al. 2025, as used by the public speedrun), kept literal
# here rather than imported so the test does not depend on train_gpt.py's copy.
POLAR_EXPRESS_5 = [
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
]


def test_reproduces_polar_express_5():
    derived = derive_schedule(1e-3, 5, safety=1.02, cushion=0.02)
    np.testing.assert_allclose(np.array(derived), np.array(POLAR_EXPRESS_5), rtol=1e-9)


def test_train_gpt_ships_the_published_table():
    import train_gpt as ns
    np.testing.assert_allclose(np.array(ns.POLAR_EXPRESS_COEFFS), np.array(POLAR_EXPRESS_5), rtol=0)


@pytest.mark.parametrize("lower, upper", [(0.02, 1.0), (0.3, 1.0), (0.05, 1.9), (0.9, 1.1)])
def test_remez_matches_a_linear_program_on_a_grid(lower, upper):
    # Independent check: minimize t subject to |1 - p(x_i)| <= t on a fine grid (an LP in
    # a, b, c, t). The grid optimum can only be slightly below the continuous one.
    coeffs, level = minimax_quintic(lower, upper)
    check_minimax(coeffs, level, lower, upper)
    x = np.linspace(lower, upper, 4001)
    basis = np.stack([x, x**3, x**5], axis=1)
    ones = np.ones((len(x), 1))
    constraints = np.block([[basis, -ones], [-basis, -ones]])  # p - t <= 1 and -p - t <= -1
    bounds = np.concatenate([np.ones(len(x)), -np.ones(len(x))])
    lp = linprog(c=[0, 0, 0, 1], A_ub=constraints, b_ub=bounds, bounds=[(None, None)] * 4, method="highs")
    assert lp.success
    assert lp.x[3] <= level + 1e-9
    assert lp.x[3] >= level * (1 - 1e-3)


def test_schedule_maps_its_interval_into_the_predicted_band():
    lower, steps = 0.02, 4
    schedule = derive_schedule(lower, steps)
    final_low, final_high = singular_value_interval(schedule, lower)[-1]
    x = np.geomspace(lower, 1.0, 20001)
    for a, b, c in schedule:
        x = a * x + b * x**3 + c * x**5
    assert final_low - 1e-12 <= x.min() and x.max() <= final_high + 1e-12
    assert final_high - final_low < 0.05


@pytest.mark.parametrize("cap_final, final_low", [(False, 0.4245), (True, 0.2694)], ids=["plain", "capped"])
def test_singular_value_interval_is_the_exact_image(cap_final, final_low):
    """Each step's tracked interval is the image of the previous one: a dense grid pushed
    through the table reaches both ends and never leaves them. A capped table ends at 1, not
    at 2 - p(l) as the Polar Express interval rule would say."""
    lower = 1e-3
    schedule = derive_schedule(lower, 4, cap_final=cap_final)
    x = np.concatenate([np.geomspace(lower, 1.0, 400001), np.linspace(lower, 1.0, 400001)])
    for (a, b, c), (low, high) in zip(schedule, singular_value_interval(schedule, lower)):
        x = a * x + b * x**3 + c * x**5
        assert low - 1e-12 <= x.min() <= low + 1e-9 and high - 1e-7 <= x.max() <= high + 1e-12
    assert (high == pytest.approx(1.0, abs=1e-9)) == cap_final
    assert low == pytest.approx(final_low, abs=1e-4)


@pytest.mark.parametrize("lower, steps", [(1e-3, 5), (0.01, 4), (0.05, 3)])
def test_cap_final_ends_at_or_below_one(lower, steps):
    """cap_final changes only the last step, by one factor, so that the composed map's largest
    value on [lower, 1] is 1 (the uncapped table overshoots it)."""
    plain, capped = derive_schedule(lower, steps), derive_schedule(lower, steps, cap_final=True)
    np.testing.assert_allclose(np.array(plain[:-1]), np.array(capped[:-1]), rtol=0)
    ratio = np.array(capped[-1]) / np.array(plain[-1])
    np.testing.assert_allclose(ratio, ratio[0], rtol=1e-12)
    x = np.geomspace(lower, 1.0, 200001)
    y, z = x.copy(), x.copy()
    for step in plain:
        y = step[0] * y + step[1] * y**3 + step[2] * y**5
    for step in capped:
        z = step[0] * z + step[1] * z**3 + step[2] * z**5
    assert y.max() > 1.0 and z.max() == pytest.approx(1.0, abs=1e-6) and z.max() <= 1.0 + 1e-9


def test_rejects_a_bad_interval():
    with pytest.raises(ValueError, match=r"need 0 < lower <= upper, got \[0.0, "):
        derive_schedule(0.0, 3)
    with pytest.raises(ValueError, match=r"need 0 < lower <= upper, got \[1.5, "):
        derive_schedule(1.5, 3)


def test_committed_aol_table_comes_from_the_generator():
    """train_gpt.AOL_COEFFS is the greedy minimax schedule for [AOL_COEFFS_LOWER_BOUND, 1] in four
    steps with the last one capped at 1 (bench/aol_search.py's AOL4-l0.001-cap)."""
    import train_gpt
    np.testing.assert_allclose(np.array(derive_schedule(train_gpt.AOL_COEFFS_LOWER_BOUND, 4, cap_final=True)),
                               np.array(train_gpt.AOL_COEFFS), rtol=1e-12)


def test_committed_samples_are_captures_from_several_steps():
    """bench/momentum_samples.pt holds width-768 captures from steps 50, 150 and 300 (fit on one,
    score on the others), whose post-AOL spectra lie in (0, 1] as the Schur bound promises."""
    import torch

    from bench.derive_aol_coeffs import post_aol_singular_values
    samples = os.path.join(REPO_ROOT, "bench", "momentum_samples.pt")
    shapes = {name: tuple(stack.shape) for name, stack in torch.load(samples).items()}
    assert shapes == {f"s{step}/{shape}": (count, 768, int(shape.split("x")[1]))
                      for step in (50, 150, 300) for shape, count in (("768x768", 2), ("768x3072", 1))}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # LAPACK's fp64 SVDs: 3 s on one thread, 49 s on two of a shared 2-core VM
    try:
        spectra = post_aol_singular_values(samples)
    finally:
        torch.set_num_threads(threads)
    for name, values in spectra.items():
        assert values.max() <= 1 + 1e-9 and values.min() > 0, name


def test_the_command_line_prints_the_shipped_aol_table():
    """bench/README.md's generator command, with --cap-final, prints train_gpt.AOL_COEFFS (valid Python)."""
    import ast
    import subprocess

    import train_gpt
    done = subprocess.run([sys.executable, os.path.join(REPO_ROOT, "bench", "derive_aol_coeffs.py"), "--lower", "1e-3",
                           "--steps", "4", "--cap-final"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("# derive_schedule(lower=0.001, steps=4, safety=1.02, cushion=0.02, upper=1.0, "
                                  "cap_final=True)\nAOL_COEFFS = [\n")
    (assignment,) = ast.parse(done.stdout).body
    printed = ast.literal_eval(assignment.value)
    # to 1e-12, as above: LAPACK's solve rounds the last bits differently on another CPU
    np.testing.assert_allclose(np.array(printed), np.array(train_gpt.AOL_COEFFS), rtol=1e-12)
    assert "singular values then in [0.2694, 1]" in done.stdout.splitlines()[-2]   # capped: it ends at 1
