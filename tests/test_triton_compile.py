"""Every Triton kernel of train_gpt.py compiles for Hopper (sm_90, the speedrun's H100 and H200),
without a GPU: bench/triton_compile.py compiles each one to a cubin as a GPU run would, at every
autotune config, eagerly and as torch.compile launches it (floats as fp64), and captures the
compiled model with the GPU's fused kernels. The interpreter the rest of the suite runs kernels
in checks none of this (loop-carried types, tensor-core layouts, shared memory, dynamo's view of
a Triton launch)."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow  # a fresh process compiling 100 kernels: the full suite only (README, Test)
pytest.importorskip("triton", reason="Triton is not installed (torch ships it on Linux only)")


def compile_report(root, tmp_path, cache, *options):
    out = tmp_path / "report.json"
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache))  # the script itself leaves the interpreter
    proc = subprocess.run([sys.executable, str(root / "bench" / "triton_compile.py"), "--arch", "90", "--json", str(out),
                           *options], capture_output=True, text=True, env=env, timeout=900)
    return proc, (json.loads(out.read_text()) if out.exists() else None)


@pytest.fixture(scope="module")
def hopper(tmp_path_factory):
    tmp, cache = tmp_path_factory.mktemp("hopper"), tmp_path_factory.mktemp("triton_cache")
    proc, report = compile_report(ROOT, tmp, cache)
    return proc, report, cache


def test_every_kernel_compiles_for_hopper_at_every_config_and_fits_its_shared_memory(hopper):
    proc, report, _ = hopper
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = report["rows"]
    assert report["arch"] == 90 and report["shared_limit"] == 232448
    assert report["kernels"] == ["_capped_loss_bwd_kernel", "_capped_loss_fwd_kernel", "_gram_kernel",
                                 "_poly_apply_kernel", "_relu_square_matmul_kernel", "_sym_poly_kernel"]
    assert {r["kernel"] for r in rows} == set(report["kernels"])
    assert all(r["ok"] and 0 <= r["shared"] <= report["shared_limit"] for r in rows)
    # each autotuned kernel at every config of its GPU list (8 each), for each specialization the trainer launches
    assert report["configs"] == dict.fromkeys(report["kernels"], 8) | {
        "_capped_loss_fwd_kernel": 1, "_capped_loss_bwd_kernel": 1}
    for name in report["kernels"]:
        for spec in {(r["launch"], r["specialization"]) for r in rows if r["kernel"] == name}:
            configs = [r["config"] for r in rows if r["kernel"] == name and (r["launch"], r["specialization"]) == spec]
            expected = report["configs"][name] if spec[0] == "eager" else 1  # fp64 scalars: the first config only
            assert len(configs) == len(set(configs)) == expected, (name, spec)
    specs = {(r["kernel"], r["specialization"]) for r in rows}
    assert ("_gram_kernel", "bf16, WITH_ROW_ABS_SUM=True, IEEE_FP32=False") in specs  # aol's first Gram
    assert {("_relu_square_matmul_kernel", f"bf16, FORWARD={f}, IEEE_FP32=False") for f in (True, False)} <= specs
    for loss in ("_capped_loss_fwd_kernel", "_capped_loss_bwd_kernel"):  # 3 weights, and the last third's 1
        assert {spec for kernel, spec in specs if kernel == loss} == {"bf16", "bf16, n_weights=1"}
    # the kernels with float arguments, as torch.compile launches them too (the orthogonalizer and the loss)
    compiled = {r["kernel"] for r in rows if r["launch"] == "compiled"}
    assert compiled == {"_sym_poly_kernel", "_poly_apply_kernel", "_capped_loss_fwd_kernel", "_capped_loss_bwd_kernel"}
    assert "0 failed; every config fits in shared memory" in proc.stdout


def test_the_compiled_model_captures_the_gpus_fused_kernels_whole(hopper):
    """torch.compile of the model at the record's scope (CPU capture, AOT autograd) with the fused
    loss and MLP a GPU run takes: the same graphs as with the torch twins (what bench/gpu_proof.py
    expects of a GPU), no graph break, the three kernels' launches traced; compiled alone, the loss
    puts one kernel in its forward graph and one in its backward."""
    capture = hopper[1]["capture"]
    assert "error" not in capture, capture
    twins, gpu = capture["twins"], capture["gpu_kernels"]
    assert twins["graphs_round1"] == gpu["graphs_round1"] == 4   # training, validation and the FP8 op bodies
    assert twins["new_graphs_round2"] == gpu["new_graphs_round2"] == 0
    assert twins["graph_breaks"] == gpu["graph_breaks"] == 0 and gpu["eager_fallbacks"] == 0
    assert gpu["launched"] == ["_capped_loss_bwd_kernel", "_capped_loss_fwd_kernel", "_relu_square_matmul_kernel"]
    assert capture["loss_kernels_in_graph"] == {"forward": 1, "backward": 1}


def test_a_kernel_the_interpreter_runs_but_a_gpu_cannot_compile_is_named(hopper, tmp_path):
    """The loss kernel before its fp32 casts: under torch.compile its running max became fp64 in
    the loop (a CompilationError on any GPU), while the interpreter ran it and the tests passed."""
    copy = tmp_path / "repo"
    for part in ("bench/triton_compile.py", "bench/gpu_proof.py", "data/cli_util.py", "train_gpt.py"):
        (copy / part).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(ROOT / part, copy / part)
    shutil.copytree(ROOT / "harness", copy / "harness")
    source = (copy / "train_gpt.py").read_text()
    cast = "        height, shift, width = _as_fp32(height), _as_fp32(shift), _as_fp32(width)\n"
    forward = source.index("def _capped_loss_fwd_kernel(")
    assert source.count(cast) == 2 and source.index(cast, forward) < source.index("def _capped_loss_bwd_kernel(")
    at = source.index(cast, forward)
    (copy / "train_gpt.py").write_text(source[:at] + source[at + len(cast):])
    proc, report = compile_report(copy, tmp_path, hopper[2], "--no-capture")  # the others: the first run's cache
    assert report["capture"] is None
    assert proc.returncode == 1
    failed = [r for r in report["rows"] if not r["ok"]]
    assert [(r["kernel"], r["launch"], r["specialization"]) for r in failed] == [
        ("_capped_loss_fwd_kernel", "compiled", "bf16"), ("_capped_loss_fwd_kernel", "compiled", "bf16, n_weights=1")]
    assert "Loop-carried variable running_max has initial type fp32 but is re-assigned to fp64" in failed[0]["error"]
    assert re.search(r": 2 failed;", proc.stdout) and "FAILED _capped_loss_fwd_kernel (compiled" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--arch", "75"], "--arch=75: expected one of 80, 86, 87, 89, 90, 100, 120 (compute capability x 10)"),
    (["--arch", "sm90"], "argument --arch: invalid int value: 'sm90'"),
    (["--json", "{tmp}/no/report.json"], "--json={tmp}/no/report.json: its folder does not exist"),
    (["--json", "{tmp}/old.json"], "--json={tmp}/old.json: already exists; give a new file path"),
    (["--inductor", "--arch", "80"], "--inductor: generates code for an H100 only (--arch 90), not --arch=80"),
])
def test_bad_options_fail_in_one_line_before_any_compile(tmp_path, args, message):
    (tmp_path / "old.json").write_text("kept")
    args = [a.format(tmp=tmp_path) for a in args]
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "triton_compile.py"), *args], capture_output=True,
                          text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr == f"triton_compile.py: error: {message.format(tmp=tmp_path)}\n"
    assert (tmp_path / "old.json").read_text() == "kept"
