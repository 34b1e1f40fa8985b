"""bench/orthogonalize.py's metrics and bench/aol_search.py end to end on small synthetic captures."""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from conftest import ROOT

sys.path.insert(0, str(ROOT))
import train_gpt  # noqa: E402
from bench.derive_aol_coeffs import derive_schedule  # noqa: E402
from bench.orthogonalize import accuracy, polar_factor  # noqa: E402


def test_metrics_of_known_outputs(monkeypatch):
    """An output of 0.5 x the polar factor has cosine 1, RMS 0.5 and polar error 0.5; a sign flip
    of half the singular directions has cosine 0; the singular values come back exactly."""
    torch.manual_seed(0)
    G = torch.randn(2, 16, 48)
    reference = polar_factor(G.to(torch.bfloat16))
    U, _, Vh = torch.linalg.svd(reference, full_matrices=False)
    flip = torch.ones(16, dtype=torch.float64)
    flip[8:] = -1

    for output, cosine, rms, error in [(0.5 * reference, 1.0, 0.5, 0.5),
                                       (U @ torch.diag(flip) @ Vh, 0.0, 1.0, 2 ** 0.5)]:
        monkeypatch.setattr("bench.orthogonalize.emulated_bf16", lambda *a, out=output: out.float())
        metrics, sv = accuracy(G, reference, "aol", None)
        torch.testing.assert_close(metrics["cosine"], torch.full((2,), cosine, dtype=torch.float64), atol=1e-6, rtol=0)
        torch.testing.assert_close(metrics["rms"], torch.full((2,), rms, dtype=torch.float64), atol=1e-6, rtol=0)
        torch.testing.assert_close(metrics["error"], torch.full((2,), error, dtype=torch.float64), atol=1e-6, rtol=0)
        assert sv.shape == (32,)
        torch.testing.assert_close(sv, torch.full((32,), rms, dtype=torch.float64), atol=1e-6, rtol=0)


def synthetic_captures(path):
    """Three 'training steps' of momentum-like matrices with decaying spectra."""
    torch.manual_seed(0)
    samples = {}
    for step in (10, 20, 30):
        samples[f"s{step}/32x32"] = (torch.randn(2, 32, 32) @ torch.diag(torch.logspace(-3, 0, 32))).bfloat16()
        samples[f"s{step}/32x96"] = (torch.randn(32, 32) @ torch.diag(torch.logspace(-2, 0, 32))
                                     @ torch.randn(32, 96))[None].bfloat16()
    torch.save(samples, path)


def test_aol_search_fits_on_one_step_and_scores_the_others(tmp_path):
    samples, out = tmp_path / "captures.pt", tmp_path / "search.json"
    synthetic_captures(samples)
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "aol_search.py"), "--samples", str(samples),
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["fit"] == "s20"
    assert sorted(report["held_out"]) == ["s10/32x32", "s10/32x96", "s30/32x32", "s30/32x96"]
    results = {r["label"]: r for r in report["results"]}
    ns5 = results["NS5"]
    for r in results.values():
        assert r["matched_muon_lr"] == pytest.approx(0.05 * ns5["rms"] / r["rms"], rel=1e-12)
        assert train_gpt.parse_ns_coeffs(r["ns_coeffs"]) == [tuple(c) for c in r["coeffs"]]
        assert r["flops_vs_ns5"] == r["steps"] / 5
    for steps in ("3", "4", "5"):
        pool = [r for r in results.values() if r["method"] == "aol" and r["steps"] == int(steps)]
        assert report["best"][steps] == min(pool, key=lambda r: r["polar_error"])["label"]
    # the data-free table for [1e-3, 1] in 5 steps is Polar Express's, whatever the captures
    np.testing.assert_allclose(results["AOL5-l0.001"]["coeffs"], train_gpt.POLAR_EXPRESS_COEFFS, rtol=1e-9)
    capped = results["AOL4-l0.01-cap"]
    np.testing.assert_allclose(capped["coeffs"], derive_schedule(0.01, 4, cap_final=True), rtol=1e-12)
    assert capped["sv_max"] <= 1.01 and capped["sv_max"] < results["AOL4-l0.01"]["sv_max"]  # bf16 aside, no overshoot
    assert "best AOL table per step count" in done.stdout


def test_aol_search_needs_two_capture_steps(tmp_path):
    samples = tmp_path / "one.pt"
    torch.save({"s5/8x8": torch.randn(1, 8, 8)}, samples)
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "aol_search.py"), "--samples", str(samples)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0 and "at least two steps" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
