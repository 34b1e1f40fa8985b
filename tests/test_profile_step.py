"""bench/profile_step.py: profiles the steps asked for, in a real (tiny) CPU run, and groups kernels."""

import gzip
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import profile_step  # noqa: E402
from conftest import tiny_argv  # noqa: E402

pytestmark = pytest.mark.slow  # launches fresh processes: the full suite only (README, Test)


def profile(out, *args, timeout=300):
    """Run bench/profile_step.py --out OUT ARGS; its table once it succeeded."""
    result = subprocess.run([sys.executable, str(ROOT / "bench" / "profile_step.py"), "--out", str(out), *args],
                            capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout, (out / "kernels.txt").read_text()


def test_profiles_the_asked_steps_of_a_cpu_run(tmp_path, make_shards):
    out = tmp_path / "prof"
    train_glob, val_glob, _ = make_shards()
    stdout, table = profile(out, "--steps", "1:2", "--", *tiny_argv(train_files=train_glob, val_files=val_glob,
                                                                   num_iterations=4))
    assert "steps 2..2 written" in stdout
    # the short run's log lies beside the profile, not among the runs in records/
    assert len(list((out / "logs").glob("*_dev/*.txt"))) == 1 and str(out / "logs") in stdout
    assert "aten::mm" in table and "# of Calls" in table
    trace = json.load(gzip.open(out / "trace.json.gz"))
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    assert not (out / "trace.json").exists()
    figures = json.loads((out / "profile.json").read_text())
    assert figures["steps"] == [2, 2] and figures["script"] == "train_gpt.py"
    assert figures["device_ms_per_step"] is None and figures["host_syncs_per_step"] is None  # CPU: no kernels, no syncs
    assert not (out / "syncs.txt").exists()


def test_bad_steps_and_an_existing_profile_fail_in_one_line(tmp_path, capsys):
    for steps in ("5:3", "x", "-1:2", "0:2"):  # no hook runs before step 1 (asked here: a launch loads torch)
        with pytest.raises(SystemExit) as exit_:
            profile_step.main(["--out", str(tmp_path), "--steps", steps])
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and "--steps" in err and len(err.strip().splitlines()) == 1, err
    (tmp_path / "kernels.txt").write_text("earlier profile")
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "profile_step.py"), "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and "kernels.txt exists" in r.stderr
    assert (tmp_path / "kernels.txt").read_text() == "earlier profile"


def test_kernel_categories_and_span():
    def kernel(name, ts, dur):
        return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}
    trace = {"traceEvents": [
        kernel("nvjet_sm90_tst_192x192_64x3_2x1_v_bz_coopB_NNN", 0, 300),
        kernel("triton_tem_fused__unsafe_view_flex_attention_backward_1", 400, 200),
        kernel("triton_poi_fused__unsafe_view_pow_relu_10", 700, 100),
        kernel("void at::native::elementwise_kernel<128, 4, at::native::gpu_kernel_impl_nocast<...>", 900, 100),
        {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000},
    ]}
    summary = profile_step.summarize(profile_step.device_time_per_step(trace, steps=2))
    rows = {line[:28].strip(): line[28:].split() for line in summary.splitlines()[1:]}
    assert rows["GEMM (cuBLAS/CUTLASS)"] == ["0.1", "0.5"]      # 300 us over 2 steps
    assert rows["FlexAttention"][0] == "0.1" and rows["inductor kernels"][0] == "0.1"
    assert rows["ATen element-wise"][0] == "0.1"
    assert rows["all kernels"] == ["0.3"] and rows["span (first to last kernel)"] == ["0.5"]
    figures = profile_step.device_time_per_step(trace, steps=2)
    assert figures["GEMM (cuBLAS/CUTLASS)"] == (0.15, 0.5) and figures["span (first to last kernel)"] == (0.5, None)
    assert profile_step.device_time_per_step({"traceEvents": trace["traceEvents"][-1:]}, steps=2) is None


def test_idle_time_is_split_into_launch_gaps_and_long_gaps():
    """Idle time inside the span: gaps between device activity (kernels, memsets, copies; kernels on
    two streams overlap) under 10 us are launch latency, the rest waiting."""
    def event(cat, ts, dur):
        return {"ph": "X", "cat": cat, "name": "triton_poi_fused_add_0", "ts": ts, "dur": dur}
    trace = {"traceEvents": [
        event("gpu_memcpy", -300, 100),  # before the first kernel, outside the span: 200 us that are no gap in it
        event("kernel", 0, 100),
        event("kernel", 104, 100),       # 4 us after: a launch gap
        event("kernel", 150, 200),       # another stream, overlapping: no gap
        event("gpu_memset", 352, 2),     # 2 us gap, then a memset keeps the GPU busy
        event("kernel", 360, 40),        # 6 us gap
        event("gpu_memcpy", 900, 50),    # 500 us waiting
        event("kernel", 1000, 100),      # 50 us waiting
        event("cpu_op", 0, 5000),        # host time is not device activity
        event("gpu_memcpy", 1090, 100),  # overlaps the last kernel, ends after it
        event("gpu_memcpy", 1500, 10),   # after the span
    ]}
    figures = profile_step.device_time_per_step(trace, steps=2)
    assert figures["idle, gaps < 10 us"] == pytest.approx(((4 + 2 + 6) / 1e3 / 2, 3 / 2))
    assert figures["idle, gaps >= 10 us"] == pytest.approx(((500 + 50) / 1e3 / 2, 2 / 2))
    assert figures["span (first to last kernel)"] == (1100 / 1e3 / 2, None)
    instant = profile_step.device_time_per_step({"traceEvents": [event("kernel", 5, 0)]}, steps=1)
    assert instant["idle, gaps < 10 us"] == (0, 0) and instant["span (first to last kernel)"] == (0, None)


def sync_here():
    warnings.warn(f"{profile_step.SYNC_WARNING} (x.item())")


def sync_there():
    warnings.warn(profile_step.SYNC_WARNING)


def other_warning(text):
    warnings.warn(text)


def test_host_syncs_are_counted_by_line_and_other_warnings_go_on_as_before():
    here, there = (f"{__file__}:{f.__code__.co_firstlineno + 1}" for f in (sync_here, sync_there))
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("default")   # python's own: each other warning once per line
        warnings.filterwarnings("ignore", message="ignored here")
        with profile_step.SyncCounter() as counter:
            for _ in range(3):
                sync_here()
                other_warning("something else")
                other_warning("ignored here")
            sync_there()
        sync_here()   # the counter is gone: shown again
    assert [str(w.message) for w in shown] == ["something else", f"{profile_step.SYNC_WARNING} (x.item())"]
    per_step, text = counter.report(steps=2)
    assert per_step == 2.0
    lines = text.splitlines()
    assert lines[0].startswith("4 host syncs in 2 steps (2.0 per step)")
    assert lines[1].split() == ["3", here] and lines[2].split() == ["1", there]


def test_profiles_another_script_by_its_optimizer_steps(tmp_path):
    script = tmp_path / "tiny_train.py"
    script.write_text(
        "import sys, torch\n"
        "assert sys.argv[1:] == ['--flag', '7'], sys.argv\n"
        "model = torch.nn.Linear(8, 8)\n"
        "opts = [torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.Adam(model.parameters())]\n"
        "for step in range(4):\n"
        "    model(torch.randn(16, 8)).square().sum().backward()\n"
        "    for opt in opts:\n"
        "        opt.step()\n"
        "    model.zero_grad()\n")
    out = tmp_path / "prof"
    stdout, table = profile(out, "--steps", "1:3", "--script", str(script), "--", "--flag", "7", timeout=120)
    assert "steps 2..3 written" in stdout
    assert "aten::addmm" in table or "aten::linear" in table
    # both optimizers stepped inside the window (2 steps x 1 each), the first one alone counted
    trace = json.load(gzip.open(out / "trace.json.gz"))
    names = [e.get("name", "") for e in trace["traceEvents"]]
    assert sum(n.startswith("Optimizer.step#SGD.step") for n in names) == 2
    assert sum(n.startswith("Optimizer.step#Adam.step") for n in names) == 2
    missing = subprocess.run([sys.executable, str(ROOT / "bench" / "profile_step.py"), "--out", str(tmp_path / "x"),
                              "--script", str(tmp_path / "none.py")], capture_output=True, text=True, timeout=60)
    assert missing.returncode == 2 and "--script" in missing.stderr and "no such file" in missing.stderr


def test_profiles_another_script_by_its_step_lines(tmp_path):
    """--steps-by log: a script whose optimizer is no torch.optim one (the 2026 record's) is counted
    by its console's step lines, the speedrun's format: the window holds steps A+1..B exactly. The
    script finds the module beside it by name, as under `python script`."""
    (tmp_path / "helper.py").write_text("def work(x):\n    return x @ x\n")
    script = tmp_path / "record_like.py"
    script.write_text(
        "import torch\n"
        "from helper import work\n"
        "print('Compiling model and warming up kernels')\n"
        "x = torch.randn(32, 32)\n"
        "for step in range(1, 6):\n"
        "    with torch.profiler.record_function(f'work{step}'):\n"
        "        work(x)\n"
        "    print(f'step:{step}/5 train_time:{10 * step}ms step_avg:10.00ms')\n")
    out = tmp_path / "prof"
    stdout, _ = profile(out, "--steps", "1:3", "--steps-by", "log", "--script", str(script), timeout=120)
    assert "steps 2..3 written" in stdout and "step:5/5 train_time:50ms" in stdout
    assert json.loads((out / "profile.json").read_text())["steps_by"] == "log"
    names = {e.get("name", "") for e in json.load(gzip.open(out / "trace.json.gz"))["traceEvents"]}
    assert {"work2", "work3"} <= names and not names & {"work1", "work4", "work5"}


def test_kernel_families_by_name():
    family = profile_step.kernel_category
    assert family("_poly_apply_kernel") == "orthogonalization (Triton)"
    assert family("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>") == "GEMM (cuBLAS/CUTLASS)"
    assert family("void cublasLt::splitKreduce_kernel<32, 16>") == "GEMM (cuBLAS/CUTLASS)"
    assert family("triton_red_fused__log_softmax_1") == "inductor kernels"
    assert family("ncclDevKernel_AllGather_RING_LL") == "NCCL"


def test_a_window_past_the_runs_last_step_is_refused_before_the_run(tmp_path):
    out = tmp_path / "prof"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "profile_step.py"), "--out", str(out), "--steps", "4:9",
                        "--", "--preset", "cpu", "--num_iterations", "5"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "--steps=4:9" in r.stderr and "step 5" in r.stderr and "--num_iterations" in r.stderr
    assert not out.exists() and "step:" not in r.stdout   # refused before anything ran
    bad = subprocess.run([sys.executable, str(ROOT / "bench" / "profile_step.py"), "--out", str(out),
                          "--", "--bogus", "1"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert bad.returncode == 2 and "unknown option --bogus" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("ending, status", [("", 1), ("raise SystemExit(3)\n", 3)])
def test_a_run_that_ends_inside_the_window_stops_the_profiler_and_exits_cleanly(tmp_path, ending, status):
    """Nothing profiled is a failure (1), unless the run failed itself: its own status is kept."""
    script = tmp_path / "short_train.py"
    script.write_text(
        "import torch\n"
        "model = torch.nn.Linear(8, 8)\n"
        "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "for step in range(3):\n"
        "    model(torch.randn(16, 8)).square().sum().backward()\n"
        "    opt.step()\n" + ending)
    out = tmp_path / "prof"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "profile_step.py"), "--out", str(out),
                        "--steps", "1:5", "--script", str(script)],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == status, (r.returncode, r.stderr[-2000:])  # it was -11: the profiler left running
    assert "the run ended before step 5: nothing profiled" in r.stderr
    assert "callback is not found" not in r.stderr and not (out / "kernels.txt").exists()
