"""bench/gpu_proof.py: the CPU smoke run goes end to end through every phase and writes a report
with the structure and figures the GPU run will fill; bad arguments fail in one line before any
work; logs are parsed in the speedrun's line format; reports of several commands merge."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_proof.py"
PEER = ROOT.parent / "shared" / "peers" / "modded-nanogpt_9d9dc969_train_gpt.py"
PEER_2026 = ROOT.parent / "shared" / "peers" / "modded-nanogpt_93f0e6b9" / "train_gpt.py"   # the default peer's source
sys.path.insert(0, str(ROOT))

from bench import gpu_proof  # noqa: E402
from conftest import processes_naming, sigint_as_at_a_terminal, signal_when_training  # noqa: E402

pytestmark = pytest.mark.slow  # launches fresh processes: the full suite only (README, Test)


@pytest.fixture(autouse=True)
def config_checks_asked_here(monkeypatch):
    """parse_args asks train_gpt.py what it says of the runs' flags in a child process, which loads
    torch (2 s a call, on two dozen tests); a test calling parse_args in this process asks the
    child's own function here. Every proof launched as a process (the smoke run with --cpu-smoke;
    a bad value without it, below) still asks its child."""
    monkeypatch.setattr(gpu_proof, "trainer_config_errors", gpu_proof.trainer_config_errors_here)


def run(*args, timeout=60, env=None):
    env = dict(os.environ, TRITON_INTERPRET="1", **(env or {}))
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    """One --cpu-smoke run of every phase (about a minute on 2 idle cores); with the public peer
    script where ../shared is present, so its copy and edits are made and checked too."""
    out = tmp_path_factory.mktemp("proof") / "out"
    args = ["--cpu-smoke", "--out", str(out)] + (["--peer", str(PEER)] if PEER.exists() else [])
    result = run(*args, timeout=600)   # a guard against a hang, not a timing assertion
    assert result.returncode == 0, result.stdout + result.stderr
    return out, json.loads((out / "report.json").read_text()), (out / "report.md").read_text()


def parse_error(capsys, *argv):
    """The one line parse_args prints before it exits 2, asked in this process (a launch of the
    script costs seconds; test_kernel_gpus_... checks the launched form once)."""
    with pytest.raises(SystemExit) as exited:
        gpu_proof.parse_args(list(argv))
    assert exited.value.code == 2
    return capsys.readouterr().err


def rows(phase, title_start):
    tables = [t for t in phase["tables"] if t["title"].startswith(title_start)]
    assert len(tables) == 1, [t["title"] for t in phase["tables"]]
    return [dict(zip(tables[0]["columns"], row)) for row in tables[0]["rows"]]


def test_smoke_report_has_every_phase(smoke):
    out, report, markdown = smoke
    assert list(report["phases"]) == list(gpu_proof.DEFAULT_PHASES)   # warm only when named
    status = {name: p["status"] for name, p in report["phases"].items()}
    assert status == {"env": "ok", "correct": "ok", "kernels": "ok", "train": "ok", "peer": "skipped"}
    assert report["cpu_smoke"] and report["meta"]["device"] == "cpu"
    assert report["meta"]["train_gpt_sha256"] == gpu_proof.file_sha256(gpu_proof.TRAINER)
    for name in gpu_proof.DEFAULT_PHASES:
        assert f"## {name}: {status[name]}" in markdown
    assert "CPU smoke run" in markdown


def test_smoke_correctness_checks_ran_and_passed(smoke):
    correct = smoke[1]["phases"]["correct"]
    assert correct["checks"]["failed"] == 0 and not correct["errors"]
    kernels = rows(correct, "Triton kernels")
    assert {r["kernel"] for r in kernels} == {"gram", "gram row |A| sums (fp32)", "sym_poly", "sym_poly scaled",
                                             "poly_apply", "poly_apply scaled"}
    ortho = rows(correct, "orthogonalize_triton")
    assert {r["ns_method"] for r in ortho} == {"aol", "polar_express", "newton_schulz"}
    assert {r["shape (batch)"].split()[0] for r in ortho} >= {"6x12", "16x16", "16x64", "64x16"}  # tall too
    mlp = rows(correct, "Fused MLP")
    assert {r["tensor"] for r in mlp} == {"output", "grad x", "grad fc_w", "grad proj_w"}
    loss = rows(correct, "Fused multi-token loss")  # eager only: dynamo cannot trace the interpreter
    assert [r["tensor"] for r in loss] == ["losses (3 weights)", "grad logits (3 weights)", "losses (1 weight)",
                                           "grad logits (1 weight)"] and all(r["shape"] == "45x1000" for r in loss)
    assert any("fused loss compiled: skipped" in n for n in correct["notes"])
    for r in kernels + ortho + mlp + loss:
        assert r["ok"] == "yes" and r["triton err"] <= r["bound"] < 1e-3  # fp32 on CPU: far below bf16 rounding
    attention = rows(correct, "FlexAttention")
    outputs = [r for r in attention if r["tensor"] == "output"]
    assert len(outputs) == 3 and all(r["ok"] == "yes" and r["flex err"] < 1e-5 for r in outputs)
    assert all(r["sdpa err"] < 1e-5 for r in attention)  # SDPA's gradients against the fp64 reference
    token_windows = rows(correct, "Token windows")  # on CPU the varlen masks only: no kernel runs there
    assert {r["tensor"] for r in token_windows} == {"varlen mask = dense mask"} and len(token_windows) == 6
    assert all(r["ok"] == "yes" for r in token_windows) and any("paired" in r["heads"] for r in token_windows)
    compile_rows = {(r["scope"], r["count"]): r for r in rows(correct, "torch.compile")}
    # the record's scope: one graph for training, one for validation, and the FP8 head's two op bodies
    assert compile_rows["model", "graphs_round1"]["measured"] == 4
    assert compile_rows["blocks", "graphs_round1"]["measured"] > 4  # the blocks' variants, the head, the bodies
    assert all(compile_rows[scope, "graph_breaks"]["measured"] == 0 for scope in ("model", "blocks"))
    # the capture includes the FP8 head's op bodies compiled as on CUDA, and nothing recompiles at a later
    # window (backend eager: torch's first-call aliasing check, which made the bodies recompile, runs only
    # under AOT autograd; tests/test_model.py::test_fp8_op_bodies_are_captured_once covers that)
    assert correct["values"]["compile_expected_hw"] == "cpu, sdpa, fp8=True (op bodies compiled)"
    assert all(compile_rows[scope, "new_graphs_round2"]["measured"] == 0 for scope in ("model", "blocks"))
    fp8 = rows(correct, "FP8 head")  # on CPU too, at small shapes: the preset's scales and bf16 weight first
    assert [(r["scales"], r["weight"], r["tensor"]) for r in fp8[:3]] == [("2026", "bfloat16", t)
                                                                          for t in ("logits", "grad_x", "grad_w")]
    assert {(r["scales"], r["weight"]) for r in fp8} == {(k, d) for k in ("2026", "bounded")
                                                         for d in ("bfloat16", "float32")} and len(fp8) == 12
    assert all(r["ok"] == "yes" and 0 < r["fp8 err"] <= r["bound"] and r["bf16 err"] < r["fp8 err"] for r in fp8)


def test_smoke_kernels_table_covers_every_method_and_backend(smoke):
    kernels = smoke[1]["phases"]["kernels"]
    assert {"768x768", "768x3072"} <= set(kernels["values"]["muon_matrices"])  # q,k,v,o and the MLP, wide
    timed = rows(kernels, "Orthogonalizing one rank")
    assert {(r["ns_method"], r["backend"]) for r in timed} == {(m, b) for m in ("aol", "polar_express", "newton_schulz")
                                                               for b in ("triton", "torch")}
    assert all(r["ms"] > 0 and r["TFLOP/s"] > 0 for r in timed)
    ns_torch = [r for r in timed if (r["ns_method"], r["backend"]) == ("newton_schulz", "torch")]
    assert all(r["vs torch NS"] == 1 for r in ns_torch)
    assert {r["steps"] for r in timed if r["ns_method"] == "aol"} == {4}
    attention = rows(kernels, "Attention through attend")
    assert {(r["window (blocks)"], r["pass"]) for r in attention} == {(1, "forward + backward"), (3, "forward + backward"),
                                                                     (3, "forward (validation, documents whole)")}
    assert all(r["flex mask ms"] > 0 and r["varlen mask ms"] > 0 and r["flex ms"] is None for r in attention)


def test_kernel_parts_choose_what_the_kernels_phase_times(tmp_path, capsys):
    opts = gpu_proof.parse_args(["--cpu-smoke", "--out", str(tmp_path / "out"), "--phases", "kernels",
                                 "--kernel-parts", "attention"])
    assert opts.kernel_parts == ["attention"]
    rec = gpu_proof.Recorder(str(tmp_path / "kernels.json"), "kernels")
    gpu_proof.phase_kernels(rec, {"cpu_smoke": True, "deadline": time.time() + 600, "kernel_parts": opts.kernel_parts})
    assert [t["title"].split(":")[0] for t in rec.data["tables"]] == ["Attention through attend (the trainer's call)"]
    assert not rec.data["errors"] and len(rec.data["tables"][0]["rows"]) == 5  # 4 training shapes, 1 validation
    for bad in ("attention,attention", "flash", ""):
        assert parse_error(capsys, "--out", str(tmp_path / "x"), "--phases", "env", "--kernel-parts", bad) == \
            f"gpu_proof.py: error: --kernel-parts={bad!r}: expected some of muon,attention, each once\n"


def test_kernel_gpus_choose_the_stacks_a_short_budget_times(tmp_path, capsys):
    """--kernel-gpus 1: only one GPU's stacks (the 8 GPUs' were timed compiled on 2026-11-26, one
    GPU's not); a world size the speedrun has no layout for is refused in one line."""
    import time
    opts = gpu_proof.parse_args(["--cpu-smoke", "--out", str(tmp_path / "out"), "--phases", "kernels",
                                 "--kernel-gpus", "1"])
    assert opts.kernel_gpus == [1]
    rec = gpu_proof.Recorder(str(tmp_path / "kernels.json"), "kernels")
    gpu_proof.phase_kernels(rec, {"cpu_smoke": True, "deadline": time.time() + 600, "kernel_gpus": opts.kernel_gpus})
    timed = rec.data["tables"][0]["rows"]
    assert timed and {r[0] for r in timed} == {1}
    assert any("world size 1," in n for n in rec.data["notes"])
    summary = {(r[0], r[1], r[2]): r[3] for r in rec.data["tables"][1]["rows"]}
    assert summary[(1, "newton_schulz", "torch")] > 0 and summary[(8, "newton_schulz", "torch")] is None
    def message(bad):
        return f"gpu_proof.py: error: --kernel-gpus={bad!r}: expected 1, 8, 8,1 or 1,8\n"
    launched = run("--out", str(tmp_path / "x"), "--phases", "env", "--kernel-gpus", "2")  # as a user meets it
    assert launched.returncode == 2 and launched.stderr == message("2"), launched.stderr
    for bad in ("8,8", ""):
        assert parse_error(capsys, "--out", str(tmp_path / "x"), "--phases", "env", "--kernel-gpus", bad) == message(bad)


def test_kernels_phase_gives_up_a_backend_that_fails_on_a_whole_stack(tmp_path, monkeypatch):
    """On the H100 the compiled Triton backend failed on every stack, about 10 s each, and spent the
    budget meant for the 8-GPU stacks. A backend that fails on every method of one stack is not
    tried on later stacks; the other backends still time every stack."""
    import time

    import train_gpt
    calls = []

    def broken(G, method="newton_schulz", coeffs=None):
        calls.append(tuple(G.shape))
        raise RuntimeError("planted failure")
    monkeypatch.setattr(train_gpt, "orthogonalize_triton", broken)
    rec = gpu_proof.Recorder(str(tmp_path / "kernels.json"), "kernels")
    gpu_proof.phase_kernels(rec, {"cpu_smoke": True, "deadline": time.time() + 600})
    stacks = {tuple(r[1].split(" x ")) for r in rec.data["tables"][0]["rows"]}
    assert len(stacks) >= 2   # a later stack exists, so giving up is observable
    first = calls[0]
    assert calls == [first] * len(train_gpt.NS_METHODS)   # tried on the first stack only
    assert len(rec.data["errors"]) == len(train_gpt.NS_METHODS)
    assert any("triton: failed on every ns_method" in n and "not tried on the later stacks" in n
               for n in rec.data["notes"])
    timed = rec.data["tables"][0]["rows"]
    assert {r[4] for r in timed} == {"triton", "torch"}
    torch_rows = [r for r in timed if r[4] == "torch"]
    assert len(torch_rows) == len(stacks) * len(train_gpt.NS_METHODS) and all(r[5] > 0 for r in torch_rows)
    summary = {(r[1], r[2]): r[3] for r in rec.data["tables"][1]["rows"]}
    assert all(summary[(m, "triton")] is None and summary[(m, "torch")] > 0 for m in train_gpt.NS_METHODS)


def test_kernels_phase_keeps_a_backend_that_fails_on_some_methods(tmp_path, monkeypatch):
    """A failure of one method is not a broken backend: the others are still timed on every stack.
    The per-step sums leave out what was not timed on every stack (a partial sum would understate
    its time)."""
    import time

    import train_gpt
    real = train_gpt.orthogonalize_triton
    calls = []

    def aol_broken(G, method="newton_schulz", coeffs=None):   # on every stack after the first
        calls.append((tuple(G.shape), method))
        if method == "aol" and tuple(G.shape) != calls[0][0]:
            raise RuntimeError("planted failure")
        return real(G, method, coeffs)
    monkeypatch.setattr(train_gpt, "orthogonalize_triton", aol_broken)
    rec = gpu_proof.Recorder(str(tmp_path / "kernels.json"), "kernels")
    gpu_proof.phase_kernels(rec, {"cpu_smoke": True, "deadline": time.time() + 600})
    stacks = {r[1] for r in rec.data["tables"][0]["rows"]}
    assert len({shape for shape, _ in calls}) == len(stacks) >= 2
    assert len(set(calls)) == len(stacks) * len(train_gpt.NS_METHODS)   # every method on every stack
    assert not any("not tried on the later stacks" in n for n in rec.data["notes"])
    summary = {(r[1], r[2]): r[3] for r in rec.data["tables"][1]["rows"]}
    assert summary[("aol", "triton")] is None
    assert summary[("newton_schulz", "triton")] > 0 and summary[("polar_express", "triton")] > 0


def test_muon_layout_per_rank_counts():
    """At 8 GPUs a rank orthogonalizes ceil(bucket/8) matrices of every bucket of its shape."""
    import torch
    import train_gpt
    layout = gpu_proof.muon_layout(train_gpt, torch)
    # the record's 40 attention matrices (10 blocks of 4) and 22 MLP matrices (11 of 2): 5 and 3 a rank,
    # the MLP's buckets of 8, 8 and 6 padded to 8
    assert layout["counts"] == layout["per_rank"][1] == {(768, 768): 40, (768, 3072): 22}
    assert layout["per_rank"][8] == {(768, 768): 5, (768, 3072): 3}
    assert all(math.ceil(total / 8) == layout["per_rank"][8][shape] for shape, total in layout["counts"].items())
    assert "state_tensors" in layout["source"]


def test_smoke_train_figures(smoke):
    out, report, _ = smoke
    train = report["phases"]["train"]
    main = train["values"]["main"]
    assert main["exit"] == 0 and main["steps_done"] == 4
    # near ln(vocab), not at it: the head starts at N(0, 0.005), not at zero (init 2026; 10.8217)
    assert main["val_loss_start"] == pytest.approx(math.log(50304), abs=0.05)
    assert main["val_loss_end"] < main["val_loss_start"]
    assert main["steady_ms"] > 0 and main["startup_s"] > 0 and main["peak_allocated_mib"] > 0
    assert main["graph_breaks"] == 0 and main["recompiles_timed"] == 0
    assert Path(main["log"]).is_relative_to(out)  # logs go inside --out, never into records/
    runs = rows(train, "Training runs")
    assert [r["run"] for r in runs] == ["main", "variant", "ns_method"] and all(r["exit"] == 0 for r in runs)
    assert runs[1]["flags"] == "--compile_scope blocks" and runs[1]["ns_method"] == runs[0]["ns_method"]
    assert runs[2]["ns_method"] != runs[0]["ns_method"]
    variant_log = train["values"][f"run_{runs[0]['ns_method']}_compile_scope-blocks"]["log"]
    assert "compile_scope=blocks" in Path(variant_log).read_text()  # the flag reached the trainer
    for split in ("train_000001", "val_000000"):
        assert (out / "data" / "fineweb10B" / f"fineweb_{split}.bin").exists()
    assert report["comparison"] is None  # no peer run on CPU
    # the main run ran under bench/profile_step.py, whose window ended before the steady window
    profile = train["values"]["profile_ours"]
    assert profile["steps"] == [2, 2] and profile["script"] == "train_gpt.py"
    assert profile["device_ms_per_step"] is None and (out / "profile_ours" / "kernels.txt").exists()
    assert any("ours: steps 2..2 profiled on the CPU" in n for n in train["notes"])
    assert not (out / "profile_variant").exists() and "[profile_step]" not in (
        out / f"train_{gpu_proof.run_name(runs[1]['ns_method'], runs[1]['flags'].split())}.console.txt").read_text()


@pytest.mark.skipif(not PEER.exists(), reason="../shared/peers is absent")
def test_smoke_peer_copy_changes_exactly_two_lines(smoke):
    out, report, _ = smoke
    peer = report["phases"]["peer"]
    assert peer["skipped"].startswith("needs CUDA")
    edits = rows(peer, "Edits made")
    assert sorted(e["copy"].split("#")[0].strip() for e in edits) == ["num_iterations = 4", "val_tokens = 262144"]
    assert sorted(e["original"].split("#")[0].strip() for e in edits) == ["num_iterations = 1695",
                                                                          "val_tokens = 10485760"]
    original = PEER.read_text().splitlines()
    copy = (out / "peer" / PEER.name).read_text().splitlines()
    changed = [i + 1 for i, (a, b) in enumerate(zip(original, copy)) if a != b]
    assert len(original) == len(copy) and sorted(changed) == sorted(e["line"] for e in edits)


@pytest.mark.parametrize("args, message", [
    (["--phases", "env,gpu"], "--phases='env,gpu': unknown phase gpu"),
    (["--peer", "/nonexistent/peer.py"], "--peer=/nonexistent/peer.py: no such file"),
    (["--steps", "20"], "--steps=20: must exceed 20"),
    (["--profile", "15:20"], "--profile='15:20': B must be below 20"),
    (["--profile", "0:3"], "--profile='0:3': expected A:B with integers 1 <= A < B, or 'none'"),
    (["--profile", "12-15"], "--profile='12-15': expected A:B"),
    (["--budget", "train=soon"], "--budget='train=soon'"),
    (["--ns-methods", "adam"], "--ns-methods: unknown method adam"),
    (["--variants", "--compile_scope blocks;--bogus 1"], "--variants: '--bogus 1': unknown option --bogus"),
    (["--variants", "--compile_scope blok"], "--variants: '--compile_scope blok': --compile_scope='blok': expected one of"),
    (["--variants", "--run_name x"], "--variants: --run_name: the proof sets it"),
    (["--variants", "--compile_scope blocks --ns_method"], "--variants: '--compile_scope blocks --ns_method': expected"),
    (["--main-flags", "--compile_scop blocks"], "--main-flags: '--compile_scop blocks': unknown option --compile_scop (did you mean --compile_scope?)"),
])
def test_bad_arguments_fail_in_one_line_before_any_work(tmp_path, capsys, args, message):
    out = tmp_path / "out"
    err = parse_error(capsys, "--out", str(out), *(args if "--phases" in args else ["--phases", "env", *args]))
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


@pytest.mark.parametrize("phases", [["--phases", "env,correct"], ["--phases", "train"], []])
def test_gpu_phases_without_a_gpu_are_refused_in_one_line_before_any_work(tmp_path, phases):
    """The suite hides the GPUs: a GPU phase without --cpu-smoke would spend its budget failing."""
    out = tmp_path / "out"
    result = run("--out", str(out), *phases, timeout=120)
    gpu_phases = phases[1].removeprefix("env,") if phases else "correct,kernels,train,peer"
    assert (result.returncode, result.stdout) == (2, "")
    assert result.stderr == (f"gpu_proof.py: error: needs a CUDA GPU for the {gpu_phases} phase"
                             f"{'s' * (',' in gpu_phases)} and none is visible; --cpu-smoke runs every phase at "
                             "tiny sizes on CPU, --phases env needs no GPU\n")
    assert not out.exists()


def test_env_phase_runs_without_a_gpu(tmp_path):
    """env records the machine, a CPU one too: it is the one phase that runs without --cpu-smoke."""
    out = tmp_path / "out"
    result = run("--out", str(out), "--phases", "env", "--budget", "env=280", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    env = json.loads((out / "report.json").read_text())["phases"]["env"]
    assert env["status"] == "ok" and env["values"]["device"] == "cpu"
    assert env["notes"] == ["no CUDA device: the other phases need one (or --cpu-smoke)"]


def test_variants_split_at_flags_so_ns_coeffs_keep_their_semicolons(tmp_path, capsys):
    coeffs = "3.4445,-4.775,2.0315;3,-3,1"
    opts = gpu_proof.parse_args(["--cpu-smoke", "--out", str(tmp_path / "out"), "--phases", "train",
                                 "--variants", f"--compile_scope blocks; --ns_coeffs {coeffs};",
                                 "--main-flags", "--ns_coeffs '1,1,1'"])
    assert opts.variants == [["--compile_scope", "blocks"], ["--ns_coeffs", coeffs]]
    assert opts.main_flags == ["--ns_coeffs", "1,1,1"]
    switches = gpu_proof.parse_args(["--cpu-smoke", "--out", str(tmp_path / "out"), "--phases", "train",
                                     "--variants", "--compile_adam; --normuon --compile_scope=blocks",
                                     "--main-flags", "--ns_coeffs -3,4,1 --normuon"])
    assert switches.variants == [["--compile_adam", "true"], ["--normuon", "true", "--compile_scope", "blocks"]]
    assert switches.main_flags == ["--ns_coeffs", "-3,4,1", "--normuon", "true"]
    bad = parse_error(capsys, "--out", str(tmp_path / "x"), "--phases", "env", "--variants", "--ns_coeffs 1,2;3,4,5")
    assert "--variants: '--ns_coeffs 1,2;3,4,5': --ns_coeffs=" in bad, bad
    unclosed = parse_error(capsys, "--out", str(tmp_path / "x"), "--phases", "env", "--variants", "--run_name 'x")
    assert "No closing quotation" in unclosed and len(unclosed.strip().splitlines()) == 1


def test_existing_report_is_never_overwritten(tmp_path):
    (tmp_path / "report.json").write_text("{}")
    result = run("--out", str(tmp_path), "--phases", "env")
    assert result.returncode == 2 and "report.json exists" in result.stderr
    assert (tmp_path / "report.json").read_text() == "{}"


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the processes in /proc")
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_proof_ends_its_worker_and_trainers_in_one_line(tmp_path, signum):
    """The worker runs in its own session (Ctrl-C at the terminal does not reach it) and so do its
    trainers: the parent ends them, then itself, in one line, and leaves the report of what ran (a
    lease's command cut short by `timeout` returns it)."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--cpu-smoke", "--phases", "env,train", "--steps", "4",
                             "--variant-steps", "4", "--variants", "", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                            env=dict(os.environ, TRITON_INTERPRET="1"), preexec_fn=sigint_as_at_a_terminal)
    stdout, stderr, ended_in, running, left = signal_when_training(proc, str(out), signum)
    assert any("--worker train" in c for c in running)
    assert proc.returncode == 128 + signum, stderr
    assert stderr == f"gpu_proof.py: interrupted ({signal.Signals(signum).name})\n"
    assert not left   # neither the worker nor its trainer goes on
    assert ended_in < 8   # the worker ended on its SIGTERM, before the parent's SIGKILL 10 s later
    report = json.loads((out / "report.json").read_text())
    assert {name: phase["status"] for name, phase in report["phases"].items()} == {"env": "ok", "train": "interrupted"}
    assert report["meta"]["train_gpt_sha256"] and (out / "report.md").exists()


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the processes in /proc")
def test_a_proof_killed_outright_leaves_no_worker_or_trainer_behind(tmp_path):
    """A lease's command that outlasts its limit is killed without a signal to handle: the worker
    and its trainers, each in a session of its own, must not live on, holding the GPU that the
    next call needs. The worker sees its parent gone within a second and ends them."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(SCRIPT), "--cpu-smoke", "--phases", "train", "--steps", "300",
                             "--profile", "none", "--variants", "", "--out", str(out)],   # a train_gpt.py, for minutes
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT, env=dict(os.environ, TRITON_INTERPRET="1"))
    _, _, _, running, left = signal_when_training(proc, str(out), signal.SIGKILL)
    assert any("--worker train" in c for c in running) and any("train_gpt.py" in c for c in running)
    assert not left


def test_a_worker_whose_proof_died_before_it_looked_ends_at_once(tmp_path):
    """The worker learns its proof's pid from the proof, not from getppid(): a proof killed while
    its worker was still starting (Python, imports) leaves a worker whose parent is init already,
    and that one would run its whole phase, trainers and all."""
    out = tmp_path / "out"
    (out / "phases").mkdir(parents=True)
    (out / "settings.json").write_text(json.dumps({"budgets": {"env": 60}}))
    gone = subprocess.Popen(["true"])
    gone.wait()
    started = time.time()
    result = run("--worker", "env", "--out", str(out), env={"GPU_PROOF_PARENT": str(gone.pid)})
    assert result.returncode == 128 + signal.SIGTERM and time.time() - started < 20, result.stdout


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds the processes in /proc")
def test_a_sigterm_while_a_trainer_starts_ends_that_trainer_too(tmp_path):
    """A SIGTERM between a trainer's Popen and its entry in RUNNING waits for the entry: handled at
    once, it would end the worker and leave that trainer, in its own session, running."""
    marker = f"sleeping_trainer_{os.getpid()}"
    script = tmp_path / "worker.py"
    script.write_text(textwrap.dedent(f"""
        import os, signal, subprocess, sys
        sys.path.insert(0, {str(ROOT)!r})
        from bench import gpu_proof
        signal.signal(signal.SIGTERM, gpu_proof.end_running_and_exit)

        class SignalledPopen(subprocess.Popen):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                os.kill(os.getpid(), signal.SIGTERM)   # handled here, before the pid is in RUNNING
        gpu_proof.subprocess.Popen = SignalledPopen
        gpu_proof.run_logged([sys.executable, "-c", "import time; time.sleep(60)", {marker!r}], ".", os.environ, 60,
                             {str(tmp_path / "trainer.log")!r})
        """))
    try:
        result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 128 + signal.SIGTERM, result.stderr
        deadline = time.time() + 5
        while processes_naming(marker) and time.time() < deadline:
            time.sleep(0.1)
        assert not processes_naming(marker)
    finally:
        for pid in processes_naming(marker):
            os.kill(pid, signal.SIGKILL)


def test_a_run_cut_by_the_budget_leaves_the_phase_partial_with_its_figures(tmp_path):
    """A lease's short call cuts its run on purpose (--total): the run's steps and steady ms/step
    so far are its figures, the phase is partial, not failed, and a note says where it was cut."""
    out = tmp_path / "out"
    # 1000 steps: about 4 s of the budget writing their data (3000's took 11 of 30); on the 2-core VM
    # the run is cut after ~60 of them (0.27 s each), a 15x margin for a faster machine
    result = run("--cpu-smoke", "--phases", "train", "--steps", "1000", "--profile", "none", "--variants", "",
                 "--budget", "train=30", "--out", str(out), timeout=120)
    train = json.loads((out / "report.json").read_text())["phases"]["train"]
    assert result.returncode == 1 and train["status"] == "partial" and not train["errors"], result.stdout
    main = train["values"]["main"]
    assert main["exit"] == "timeout" and 3 < main["steps_done"] < 1000 and main["steady_ms"] > 0
    assert f"train run {main['ns_method']}: cut short by the phase's budget after {main['steps_done']} steps; its " \
           "figures are what it reached" in train["notes"]


@pytest.mark.parametrize("memory_gib, call, total, phases, peer_budget", [
    (79.6, 1, None, ["env", "peer"], 60), (79.6, 2, 455, ["env", "train", "correct"], 60),
    (79.6, 2, 454, ["env", "kernels", "correct"], 60),
    (139.8, 1, None, ["env", "warm"], 60), (139.8, 2, 300, ["env", "peer", "train", "correct"], 60),
    (139.8, 2, 100, ["env", "peer", "train", "correct"], 32.5)])  # half of 100 less the 25 s margin and 10
def test_a_lease_call_runs_the_plan_for_its_gpu(tmp_path, monkeypatch, memory_gib, call, total, phases, peer_budget):
    """--lease 1 and 2: an H100's memory gets the record (its start-up is the longer), then ours
    where call 2 leaves its phase OURS_MIN_S (else the checks and one GPU's kernel stacks); an
    H200's gets both compiled at once, then both timed, the record with at most its share of the
    call so that ours has the rest. A second call ends with the checks, in what time is left.
    Every run 96 steps, 12 of them the extension; ours the preset with the record's attention."""
    monkeypatch.setattr(gpu_proof, "gpu_memory_gib", lambda: memory_gib)
    opts = gpu_proof.parse_args(["--cpu-smoke", "--out", str(tmp_path / "out"), "--lease", str(call)]
                                + (["--total", str(total)] if total else []))
    assert opts.phases == phases and opts.ns_methods == ["polar_express"] and opts.variants == []
    assert opts.main_flags == ["--attn_backend", "varlen"]
    assert opts.total == (total or 570) and (opts.steps, opts.extension_steps) == (96, 12)
    assert opts.kernel_gpus == ([1] if "kernels" in phases else None)
    assert opts.budgets["peer"] == peer_budget  # (the cpu smoke's 60 s, or an H200's second call's share)


@pytest.mark.parametrize("answers, memory_gib", [
    ({"nvidia-smi": "81559\n"}, 81559 / 1024),
    ({"nvidia-smi": "[N/A]\n", "python": "143771.0\n"}, 143771 / 1024),   # a MIG or container answer
    ({"python": "143771.0\n"}, 143771 / 1024),   # no nvidia-smi on the PATH
    ({}, 0.0)])
def test_the_gpu_memory_comes_from_torch_in_a_child_where_nvidia_smi_does_not_answer(monkeypatch, answers, memory_gib):
    """The lease plan is chosen by memory: a machine without a working nvidia-smi asks torch, in a
    child process (a CUDA context in the proof's own process would hold GPU memory); 0 where
    neither answers."""
    asked = []

    def fake_run(command, **kwargs):
        name = "python" if command[0] == sys.executable else command[0]
        asked.append(name)
        if name == "nvidia-smi" and name not in answers:
            raise FileNotFoundError(command[0])
        return subprocess.CompletedProcess(command, 0 if name in answers else 1, answers.get(name, ""), "")
    monkeypatch.setattr(gpu_proof.subprocess, "run", fake_run)
    assert gpu_proof.gpu_memory_gib() == pytest.approx(memory_gib)
    assert asked == (["nvidia-smi"] if answers.get("nvidia-smi", "").strip().isdigit() else ["nvidia-smi", "python"])


@pytest.mark.parametrize("args, message", [
    (["--lease", "2"], "--lease 2 needs --total SECONDS"),
    (["--lease", "1", "--phases", "env"], "--lease 1 sets --phases itself"),
    (["--total", "0"], "--total=0.0: expected a positive number of seconds"),
    (["--report-copy", "/nonexistent/1.json"], "--report-copy=/nonexistent/1.json: /nonexistent is not a writable")])
def test_bad_lease_options_fail_in_one_line(tmp_path, args, message):
    result = run("--cpu-smoke", "--out", str(tmp_path / "out"), *args)
    assert result.returncode == 2 and message in result.stderr and len(result.stderr.splitlines()) == 1


def test_a_bad_trainer_value_is_named_by_train_gpt_in_a_child_process(tmp_path):
    """Launched as a user meets it: the child process that loads train_gpt.py (not this test's
    stand-in, config_checks_asked_here) names the bad value, in one line, before any phase."""
    result = run("--out", str(tmp_path / "out"), "--phases", "env", "--variants", "--compile_scope blok")
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1
    assert "--variants: '--compile_scope blok': --compile_scope='blok': expected one of" in result.stderr
    assert not (tmp_path / "out").exists()


def test_total_cuts_each_phase_to_what_is_left_and_skips_one_with_too_little(tmp_path, monkeypatch):
    """--total: each phase's budget (which the worker reads from settings.json) is what is left of
    the command's time less the margin, and a phase with less than MIN_PHASE_S left is skipped;
    the report, and its copy, name it."""
    clock = [1000.0]
    monkeypatch.setattr(gpu_proof.time, "time", lambda: clock[0])
    budgets = {}

    def fake_phase(phase, out, budget, env):
        with open(os.path.join(out, "settings.json")) as f:
            budgets[phase] = (budget, json.load(f)["budgets"][phase])
        clock[0] += {"env": 10, "correct": 100}[phase]
        result = gpu_proof.new_phase_result(phase)
        result["status"] = "ok"
        return result
    monkeypatch.setattr(gpu_proof, "run_phase_process", fake_phase)
    copy = tmp_path / "copy.json"
    opts = gpu_proof.parse_args(["--cpu-smoke", "--out", str(tmp_path / "out"), "--phases", "env,correct,kernels",
                                 "--total", "150", "--report-copy", str(copy)])
    gpu_proof.run_proof(opts)
    left_for_correct = 150 - 10 - gpu_proof.TOTAL_MARGIN_S   # under the smoke budget of 120
    assert budgets == {"env": (60, 60), "correct": (left_for_correct, left_for_correct)}
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["phases"]["kernels"]["status"] == "skipped"
    assert report["phases"]["kernels"]["skipped"] == "15 s left of --total=150"
    assert json.loads(copy.read_text()) == report


def test_total_counts_the_option_checks_time(tmp_path, monkeypatch):
    """--total is the whole command's time: what parse_args spends (its checks load torch in child
    processes, tens of seconds on a fresh machine) comes off the phases' time, so a lease's command
    ends within the time its call was given."""
    clock = [1000.0]
    monkeypatch.setattr(gpu_proof.time, "time", lambda: clock[0])
    budgets = {}

    def fake_phase(phase, out, budget, env):
        budgets[phase] = budget
        clock[0] += 10
        result = gpu_proof.new_phase_result(phase)
        result["status"] = "ok"
        return result
    monkeypatch.setattr(gpu_proof, "run_phase_process", fake_phase)
    opts = gpu_proof.parse_args(["--cpu-smoke", "--out", str(tmp_path / "out"), "--phases", "env,correct",
                                 "--total", "150"])
    clock[0] += 40   # the checks' child processes
    gpu_proof.run_proof(opts)
    assert budgets == {"env": 60, "correct": 150 - 40 - 10 - gpu_proof.TOTAL_MARGIN_S}


def logged_settings(log):
    """The trainer's settings as its log lists them (name=value lines after the code)."""
    header = log.read_text().split("=" * 100)[-2]   # between the code and the output
    return dict(line.split("=", 1) for line in header.splitlines() if re.fullmatch(r"[a-z0-9_]+=.*", line))


def test_warm_phase_runs_the_main_run_to_its_first_timed_step_and_copies_the_peer(tmp_path):
    """--phases env,warm,train on CPU: the warm phase runs the train phase's main run, stopped at
    its first timed step (its compilation is what fills the caches), with the same settings but
    the two that do not reach a compiled graph (its schedule makes the graphs: the same steps);
    the peer's copy is made for as many steps (it needs CUDA to run); the logs stay in --out; the
    marker of a running warm phase is gone after it."""
    out, cache = tmp_path / "out", tmp_path / "inductor"
    result = run("--cpu-smoke", "--out", str(out), "--phases", "env,warm,train", "--ns-methods", "newton_schulz",
                 "--main-flags", "--compile_scope blocks", "--variants", "",
                 *(["--peer", str(PEER)] if PEER.exists() else []), timeout=300,
                 env={"TORCHINDUCTOR_CACHE_DIR": str(cache)})
    assert result.returncode == 0, result.stdout + result.stderr
    warm = json.loads((out / "report.json").read_text())["phases"]["warm"]
    assert warm["status"] == "ok" and warm["values"]["together"] is False
    assert [r["run"] for r in rows(warm, "Warm-up runs")] == ["ours"] and warm["values"]["ours"]["exit"] == "stopped"
    (log,) = (out / "warm").glob("*_warm_newton_schulz_compile_scope-blocks/*.txt")
    assert "step:1/4 " in (out / "warm_newton_schulz_compile_scope-blocks.console.txt").read_text()   # (killed there:
    assert "Resetting Model" in log.read_text()   # the log may lack that line) after the warmup compiled it all
    (timed,) = (out / "train").glob("*_proof_newton_schulz_compile_scope-blocks/*.txt")
    warm_settings, timed_settings = logged_settings(log), logged_settings(timed)
    assert warm_settings["compile_scope"] == "blocks" and warm_settings["ns_method"] == "newton_schulz"
    differ = {k for k in warm_settings.keys() | timed_settings.keys() if warm_settings.get(k) != timed_settings.get(k)}
    assert differ == {"log_dir", "run_name"}, differ
    assert warm["values"]["autotune_choices_removed"] == 0   # the CPU's kernels are C++: nothing tuned
    assert cache.is_dir() and not (cache / "gpu_proof_warm_began").exists()
    if PEER.exists():
        copy = (out / "warm" / "peer" / PEER.name).read_text()
        assert "num_iterations = 4 #" in copy and "val_tokens = 262144 #" in copy
        assert "peer: needs CUDA, not run (its copy was made)" in warm["notes"]


def test_a_run_until_a_line_is_stopped_there(tmp_path):
    """The warm phase's runs end at their first timed step (run_logged's until): at once, 'stopped'."""
    code = "import time; print('Resetting Model', flush=True); print('step:1/9 train_time:5ms step_avg:5ms', " \
           "flush=True); time.sleep(60)"
    start = time.time()
    status, lines, _ = gpu_proof.run_logged([sys.executable, "-c", code], str(tmp_path), dict(os.environ), 60,
                                            str(tmp_path / "console.txt"), until=gpu_proof.STEP_RE)
    assert status == "stopped" and time.time() - start < 30
    assert [line for _, line in lines] == ["Resetting Model", "step:1/9 train_time:5ms step_avg:5ms"]


def test_phases_run_in_the_order_given_and_report_in_reading_order(tmp_path):
    """A short lease names first the phase it lacks; the report still reads env first."""
    out = tmp_path / "out"
    result = run("--cpu-smoke", "--out", str(out), "--phases", "peer,env", timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    started = [line.split()[1] for line in result.stdout.splitlines() if line.endswith("running (budget 60 s)")]
    assert started == ["peer:", "env:"]
    assert list(json.loads((out / "report.json").read_text())["phases"]) == ["env", "peer"]


def test_warm_runs_together_overlap_and_one_after_the_other_do_not(tmp_path):
    job = [sys.executable, "-c", "import time; print(time.time(), flush=True); time.sleep(1); print(time.time())"]

    def spans(together):
        jobs = [(label, job, str(tmp_path), dict(os.environ), str(tmp_path / f"{label}.txt")) for label in "ab"]
        results, alone = gpu_proof.run_jobs(jobs, time.time() + 60, together)
        assert alone == []
        assert list(results) == ["a", "b"] and all(status == 0 for status, _, _ in results.values())
        return [[float(line) for _, line in lines] for _, lines, _ in results.values()]
    (a_start, a_end), (b_start, b_end) = spans(True)
    assert b_start < a_end and a_start < b_end
    (a_start, a_end), (b_start, b_end) = spans(False)
    assert b_start >= a_end


def test_a_job_out_of_memory_beside_the_other_runs_again_alone(tmp_path):
    """Two warm runs at once may not fit in the GPU: the one that ran out of memory runs again after
    the other has ended, alone, its console kept beside the first try's; a job failing otherwise
    is not run again."""
    tried = tmp_path / "tried"
    oom = ("import os, sys, time; p = sys.argv[1]\n"
           "if not os.path.exists(p):\n"
           "    open(p, 'w').close(); print('torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 26.0 GiB');"
           " sys.exit(1)\n"
           "print(time.time())")
    jobs = [("peer", [sys.executable, "-c", oom, str(tried)], str(tmp_path), dict(os.environ),
             str(tmp_path / "peer.console.txt")),
            ("ours", [sys.executable, "-c", "import time; time.sleep(1); print(time.time())"], str(tmp_path),
             dict(os.environ), str(tmp_path / "ours.console.txt")),
            ("bad", [sys.executable, "-c", "import sys; print('ValueError: no'); sys.exit(1)"], str(tmp_path),
             dict(os.environ), str(tmp_path / "bad.console.txt"))]
    results, alone = gpu_proof.run_jobs(jobs, time.time() + 60, together=True)
    assert alone == ["peer"]
    assert [results[label][0] for label in ("peer", "ours", "bad")] == [0, 0, 1]
    (_, ours_end), = results["ours"][1]
    (_, peer_again), = results["peer"][1]
    assert float(peer_again) > float(ours_end)
    assert "out of memory" in (tmp_path / "peer.console.txt").read_text()
    assert (tmp_path / "peer.alone.console.txt").read_text().split()[1] == peer_again


def test_a_warm_phase_cut_short_leaves_its_choices_to_the_next_phase(tmp_path, monkeypatch):
    """Killed before it removed them, the warm phase's marker stays in inductor's cache folder;
    the next train or peer phase removes what was saved since it, in both cache folders."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    (tmp_path / "inductor").mkdir()
    since = time.time()
    (tmp_path / "inductor" / "gpu_proof_warm_began").write_text(repr(since))
    older, saved = tmp_path / "inductor" / "a" / "k.best_config", tmp_path / "triton" / "b" / "k.best_config"
    for path in (older, saved):
        path.parent.mkdir(parents=True)
        path.write_text("{}")
    os.utime(older, (since - 60, since - 60))

    class Rec:
        notes = []
        note = notes.append
    gpu_proof.drop_choices_a_warm_phase_left(Rec)
    assert older.exists() and not saved.exists()
    assert not (tmp_path / "inductor" / "gpu_proof_warm_began").exists()
    assert Rec.notes == ["removed 1 autotuning choice file(s) a warm phase cut short had left"]
    gpu_proof.drop_choices_a_warm_phase_left(Rec)   # no marker: nothing to do
    assert older.exists() and len(Rec.notes) == 1


def test_trainers_keep_code_not_tuned_kernels_in_inductors_cache():
    """A cache hit must tune again (phase_warm): the proof's trainers run without Triton bundling."""
    assert gpu_proof.child_env(False)["TORCHINDUCTOR_BUNDLE_TRITON_INTO_FX_GRAPH_CACHE"] == "0"
    assert gpu_proof.child_env(True)["TORCHINDUCTOR_BUNDLE_TRITON_INTO_FX_GRAPH_CACHE"] == "0"


def test_drop_autotune_choices_removes_only_what_the_warm_runs_saved(tmp_path):
    old = [tmp_path / "inductor" / "ab" / "x.best_config", tmp_path / "triton" / "k" / "y.autotune.json"]
    new = [tmp_path / "inductor" / "cd" / "z.best_config", tmp_path / "triton" / "m" / "w.autotune.json"]
    kept = [tmp_path / "inductor" / "cd" / "z.py", tmp_path / "triton" / "m" / "w.cubin"]
    for path in old + new + kept:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("{}")
    for path in old:
        os.utime(path, (time.time() - 3600, time.time() - 3600))
    since = time.time() - 1
    removed = gpu_proof.drop_autotune_choices(since, [str(tmp_path / "inductor"), str(tmp_path / "triton"),
                                                      str(tmp_path / "inductor")])
    assert removed == 2
    assert all(p.exists() for p in old + kept) and not any(p.exists() for p in new)


def test_parse_run_log_reads_the_speedrun_line_format():
    lines = ["code with f-strings: step:{step}/{N} val_loss:{val_loss:.4f}", "=" * 100,
             "step:0/30 val_loss:10.8258 train_time:0ms step_avg:0.02ms"]
    lines += [f"step:{s}/30 train_time:{1000 + 800 * s}ms step_avg:{(1000 + 800 * s) / s:.2f}ms" for s in range(1, 31)]
    lines += ["step:30/30 val_loss:7.1234 train_time:25000ms step_avg:833.33ms",
              "peak memory allocated: 33278 MiB reserved: 48994 MiB"]
    figures = gpu_proof.parse_run_log("\n".join(lines))
    assert figures["steps_done"] == 30 and figures["steady_ms"] == pytest.approx(800)
    assert (figures["val_loss_start"], figures["val_loss_end"]) == (10.8258, 7.1234)
    assert (figures["peak_allocated_mib"], figures["peak_reserved_mib"]) == (33278, 48994)
    cut = gpu_proof.parse_run_log("\n".join(lines[:10]))   # cut short before step 20, its end never validated
    assert cut["steady_ms"] is None and cut["val_loss_start"] == 10.8258 and cut["val_loss_end"] is None


def test_ours_and_the_record_are_compared_over_the_steps_both_reached():
    """A run cut short by its budget (the lease plans it) has timed fewer steps, and step times grow
    with the attention window: the ratio is taken over steps 20..min(N), and the report says so."""
    def log(steps, ms_at):
        return "\n".join(["=" * 100] + [f"step:{s}/40 train_time:{ms_at(s):.0f}ms step_avg:1.00ms"
                                          for s in range(1, steps + 1)])
    ours = gpu_proof.parse_run_log(log(40, lambda s: 700 * s + 5 * s * s))   # slower and slower
    peer = gpu_proof.parse_run_log(log(26, lambda s: 710 * s + 5 * s * s))   # cut at step 26
    phases = {"train": fake_phase("train", values={"main": ours}), "peer": fake_phase("peer", values={"run": peer})}
    comp = gpu_proof.compare_with_peer(phases)
    assert comp["steady_window"] == [20, 26]
    assert comp["steady_ms_ours"] == pytest.approx(700 + 5 * 46) and comp["steady_ms_peer"] == pytest.approx(710 + 5 * 46)
    assert comp["steady_ms_ratio"] == pytest.approx(930 / 940)
    assert ours["steady_ms"] == pytest.approx(700 + 5 * 60)   # each its own window: 1000 / 940, 6% against ours
    text = gpu_proof.render_markdown(gpu_proof.build_report(phases, ["cmd"], False))
    assert "| steady ms/step (steps 20..26, both) | 930 | 940 |" in text


def stage_log(steps, scale):
    """A log of a 96-step run (12 of them the extension) cut at `steps`: each stage's steps cost
    its own ms x scale, its first STAGE_SKIP steps 500 more (a recompile), steps up to STEADY_FROM
    1000 more (the profile's window)."""
    cost = {"1/3": 250, "2/3": 450, "3/3": 650, "extension": 700}
    total, lines = 0.0, ["=" * 100, "step:0/96 val_loss:10.8258 train_time:0ms step_avg:0.01ms"]
    for step in range(1, steps + 1):   # the line step:s ends step s - 1
        name, first = next((name, first) for name, first, end in gpu_proof.run_stages(96, 12) if first < step <= end)
        total += (scale * cost[name] + 500 * (step - first <= gpu_proof.STAGE_SKIP)
                  + 1000 * (step <= gpu_proof.STEADY_FROM))
        lines.append(f"step:{step}/96 train_time:{total:.0f}ms step_avg:{total / step:.2f}ms")
    return "\n".join(lines), cost


def test_steady_ms_per_stage_leaves_out_each_stages_first_steps_and_compares_over_steps_both_timed():
    """The stages of 96 steps with 12 of extension are the thirds of the 84 scheduled (the record's
    get_bs and get_ws, our schedules) and the extension; each stage's steady ms/step is its own
    cost, its first steps and those before the steady window left out. The peer, cut at step 90,
    is set against ours over the extension steps both timed, and the report has the table."""
    text, cost = stage_log(96, 1.0)
    ours = gpu_proof.parse_run_log(text, extension=12)
    peer = gpu_proof.parse_run_log(stage_log(90, 1.1)[0], extension=12)
    assert [(s["stage"], s["steps"]) for s in ours["stages"]] == [("1/3", [1, 28]), ("2/3", [29, 56]),
                                                                   ("3/3", [57, 84]), ("extension", [85, 96])]
    assert [s["timed"] for s in ours["stages"]] == [[20, 28], [32, 56], [60, 84], [88, 96]]
    assert [s["ms"] for s in ours["stages"]] == pytest.approx(list(cost.values()), rel=2e-3)
    assert peer["stages"][-1]["timed"] == [88, 90] and peer["stages"][-1]["ms"] == pytest.approx(770, rel=2e-3)
    assert gpu_proof.parse_run_log(text)["steady_ms"] > 0 and "stages" not in gpu_proof.parse_run_log(text)
    phases = {"train": fake_phase("train", values={"main": dict(ours, flags="--attn_backend varlen")}),
              "peer": fake_phase("peer", values={"run": peer})}
    comp = gpu_proof.compare_with_peer(phases)
    assert [s["timed"] for s in comp["stages"]] == [[20, 28], [32, 56], [60, 84], [88, 90]]
    assert [s["ratio"] for s in comp["stages"]] == pytest.approx([1 / 1.1] * 4, rel=3e-3)
    assert comp["val_loss_start_ours"] == comp["val_loss_start_peer"] == 10.8258
    text = gpu_proof.render_markdown(gpu_proof.build_report(phases, ["cmd"], False))
    assert "(same GPU, same data; ours with `--attn_backend varlen`)" in text
    assert "| 1/3 | 1..28 |  |  | 21..28 | 250 | 275 | 0.9091 |" in text
    assert "| extension | 85..96 |  |  | 89..90 | 700 | 770 | 0.9091 |" in text
    other = dict(peer, stages=peer["stages"][:2])   # other stages (another schedule): no stage table
    assert gpu_proof.compare_with_peer({**phases, "peer": fake_phase("peer", values={"run": other})})["stages"] is None


def test_timing_data_holds_what_every_run_packs(tmp_path):
    """Neither loader goes past its shard's end (ours stops the run, the record's fails): the shard
    holds the documents that packing takes for every step (8 micro-batches of the schedule's size
    at world size 1) and for the record's warmup, and little more. Ours, which reads as the record
    reads (tests/test_record_2026_data.py), fills every step and stops where packed_positions says."""
    import dataclasses
    import glob
    import torch
    from data.shards import read_header
    tg = gpu_proof.import_trainer()
    args = gpu_proof.speedrun_args(tg)
    ctx = dict(out=str(tmp_path), steps=9, extension_steps=3, variant_steps=9, peer=None)
    train, val, note = gpu_proof.timing_data(ctx, tg, args, gpu_proof.RUN_VAL_TOKENS)
    run = dataclasses.replace(args, num_iterations=9, extension_steps=3)
    lengths = [len(d) for d in gpu_proof.sample_documents()["train"]]
    sizes = [tg.train_seq_len_at(step, run) for step in range(9) for _ in range(8)]
    assert sorted(set(sizes)) == [16384, 32768, 49152]
    warmup = [tg.train_seq_len_at(step, run) for step in tg.warmup_steps_at_transitions(run) for _ in range(8)]
    batches = tg.PackedBatches(sorted(glob.glob(train)), args.train_max_doc_len, 0, 1, chunks_per_step=8)
    try:
        for size in sizes:
            inputs, _ = batches.next_batch(torch.device("cpu"), size)
            assert inputs.numel() == size
        passed = batches._bos[batches._doc]   # where the next document starts: the tokens passed over
    finally:
        batches.close()
    assert passed == gpu_proof.packed_positions(lengths, sizes, args.train_max_doc_len)
    need = max(passed, gpu_proof.packed_positions(lengths, warmup, args.train_max_doc_len))
    (shard,) = glob.glob(train)
    assert need < read_header(shard) <= need + 65536 and f"{read_header(shard):,} train" in note
    (val_shard,) = glob.glob(val)   # the record's warmup reads one validation micro-batch per warmup step
    assert read_header(val_shard) > max(len(warmup) // 8, 8) * args.val_seq_len + gpu_proof.RUN_VAL_TOKENS


@pytest.mark.skipif(not PEER_2026.exists(), reason="../shared/peers is absent")
def test_the_2026_records_copy_makes_exactly_the_listed_edits_and_still_compiles(tmp_path):
    """The default peer cannot run on CPU, so its copy is checked as text: each edit's old text
    occurs once in the record and keeps its line count; the copy differs from the record only on
    the listed edits' lines, which read as listed; FA3 from the hub is gone and torch's
    varlen_attn gets the arguments FA3's two calls got (its window (W, 0) is causal); the
    schedule, validation tokens and cadence are the run's; triton_kernels.py comes along; both
    files still compile, and every dynamo setting the record makes exists here."""
    import ast
    import inspect
    import uuid
    import torch._dynamo
    from torch.nn.attention.varlen import varlen_attn
    original = PEER_2026.read_text()
    for old, new in gpu_proof.peer_edits(original, "2026", 96, 12):
        assert original.count(old) == 1 and old.count("\n") == new.count("\n"), old
    assert gpu_proof.peer_kind(str(PEER_2026)) == "2026" and gpu_proof.peer_kind(str(PEER)) == "2025"
    path, edits = gpu_proof.peer_copy(dict(peer=str(PEER_2026), peer_replace=[], out=str(tmp_path)), 96, 12)
    assert Path(path) == tmp_path / "peer" / "train_gpt.py"
    kernels = (tmp_path / "peer" / "triton_kernels.py").read_text()
    assert kernels == (PEER_2026.parent / "triton_kernels.py").read_text()
    copy = Path(path).read_text()
    before_lines, after_lines = original.splitlines(), copy.splitlines()
    assert len(before_lines) == len(after_lines) and len(edits) == 8
    changed = {i + 1 for i, (a, b) in enumerate(zip(before_lines, after_lines)) if a != b}
    listed = set()
    for line, before, after in edits:
        span = range(line, line + before.count("\n") + 1)
        assert "\n".join(before_lines[span[0] - 1:span[-1]]) == before
        assert "\n".join(after_lines[span[0] - 1:span[-1]]) == after
        assert changed & set(span), (line, before)   # each listed edit changes something
        listed |= set(span)
    assert changed <= listed and [e[0] for e in edits] == sorted(e[0] for e in edits)
    compile(copy, path, "exec")
    compile(kernels, "triton_kernels.py", "exec")
    tree = ast.parse(copy)
    assert "get_kernel" not in copy and "flash_attn_interface" not in copy
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module == "kernels"]
    fa3 = [n for n in ast.walk(ast.parse(original)) if isinstance(n, ast.Call)
           and ast.unparse(n.func) == "flash_attn_interface.flash_attn_varlen_func"]
    ours = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and ast.unparse(n.func) == "varlen_attn"]
    assert len(fa3) == len(ours) == 2
    for call, replaced in zip(fa3, ours):
        given = {k.arg: ast.unparse(k.value) for k in call.keywords}
        assert given.pop("causal") == "True"
        assert [ast.unparse(a) for a in replaced.args] == [ast.unparse(a) for a in call.args] + [
            given["cu_seqlens_q"], given["cu_seqlens_k"], given["max_seqlen_q"], given["max_seqlen_k"]]
        assert {k.arg: ast.unparse(k.value) for k in replaced.keywords} == {"scale": given["softmax_scale"],
                                                                             "window_size": given["window_size"]}
        assert given["window_size"] == "(bm_size, 0)"
        inspect.signature(varlen_attn).bind(*replaced.args, **{k.arg: None for k in replaced.keywords})
    assert "(W, 0) for causal attention with sliding window" in " ".join(inspect.getdoc(varlen_attn).split())
    hyper = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Hyperparameters")
    scope = {"uuid": uuid}   # the class alone, its values as its body computes them (num_iterations)
    exec(ast.get_source_segment(copy, hyper), scope)
    h = scope["Hyperparameters"]
    assert (h.num_scheduled_iterations, h.num_extension_iterations, h.num_iterations) == (84, 12, 96)
    assert h.val_tokens == gpu_proof.PEER_VAL_TOKENS["2026"] and h.val_tokens % h.val_batch_size == 0
    assert h.val_loss_every == 96   # validation at step 0 and at the end, as ours
    settings = [ast.unparse(n.targets[0]) for n in ast.walk(tree) if isinstance(n, ast.Assign)
                and ast.unparse(n.targets[0]).startswith("dynamo.config.")]
    assert settings and all(hasattr(torch._dynamo.config, s.split(".")[-1]) for s in settings)


@pytest.mark.skipif(not PEER_2026.exists(), reason="../shared/peers is absent")
def test_a_2026_peer_without_its_kernels_file_is_refused_in_one_line(tmp_path, capsys):
    alone = tmp_path / "train_gpt.py"
    shutil.copyfile(PEER_2026, alone)
    err = parse_error(capsys, "--cpu-smoke", "--out", str(tmp_path / "out"), "--phases", "peer", "--peer", str(alone))
    assert len(err.strip().splitlines()) == 1 and "triton_kernels.py must sit beside it" in err


@pytest.mark.skipif(not PEER_2026.exists(), reason="../shared/peers is absent")
def test_the_2026_peers_report_says_its_attention_is_not_fa3(tmp_path):
    """The record's ms/step on varlen_attn is not the record's own speed (FA3): the report says so."""
    out = tmp_path / "out"
    result = run("--cpu-smoke", "--out", str(out), "--phases", "peer", "--peer", str(PEER_2026), timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    peer = json.loads((out / "report.json").read_text())["phases"]["peer"]
    assert peer["skipped"].startswith("needs CUDA")
    assert any("varlen_attn (FlashAttention-2) where the record calls FA3" in n for n in peer["notes"])


def fake_phase(name, status="ok", values=None):
    return dict(gpu_proof.new_phase_result(name), status=status, values=values or {})


def test_merge_combines_commands_and_compares_with_the_peer(tmp_path):
    env = {"device": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "train_gpt_sha256": "ab"}
    first = gpu_proof.build_report({"env": fake_phase("env", values=env), "train": fake_phase("train", "failed")},
                                   ["cmd1"], False)
    profile_ours = dict(steps=[13, 15], host_syncs_per_step=1.0, device_ms_per_step={
        "GEMM (cuBLAS/CUTLASS)": [300.0, 90.0], "orthogonalization (Triton)": [20.0, 45.0]})
    profile_peer = dict(steps=[23, 25], host_syncs_per_step=0.0, device_ms_per_step={
        "GEMM (cuBLAS/CUTLASS)": [280.0, 95.0], "NCCL": [1.5, 3.0]})
    second = gpu_proof.build_report({"train": fake_phase("train", values={"main": dict(
        steady_ms=900.0, peak_allocated_mib=30000, peak_reserved_mib=40000, steps_done=60),
        "profile_ours": profile_ours})}, ["cmd2"], False)
    third = gpu_proof.build_report({"peer": fake_phase("peer", values={"run": dict(
        steady_ms=1000.0, peak_allocated_mib=25000, peak_reserved_mib=40000, steps_done=60),
        "profile_peer": profile_peer})}, ["cmd3"], False)
    paths = []
    for i, report in enumerate((first, second, third)):
        folder = tmp_path / str(i)
        gpu_proof.write_report(str(folder), report)
        paths.append(str(folder / "report.json"))
    merged = gpu_proof.merge_reports(paths)
    assert list(merged["phases"]) == ["env", "train", "peer"] and merged["phases"]["train"]["status"] == "ok"
    assert merged["commands"] == ["cmd1", "cmd2", "cmd3"] and merged["meta"]["device"] == env["device"]
    assert merged["comparison"]["steady_ms_ratio"] == pytest.approx(0.9)
    assert merged["comparison"]["peak_allocated_ratio"] == pytest.approx(1.2)
    assert gpu_proof.device_slug(merged) == "NVIDIA-H100-80GB-HBM3"
    result = run("--merge", *paths, "--out", str(tmp_path / "merged"))
    assert result.returncode == 0, result.stderr
    markdown = (tmp_path / "merged" / "report.md").read_text()
    assert "| steady ms/step (steps 20..N, each its own N) | 900 | 1000 | 0.9 |" in markdown
    # the two profiles side by side: every family either has, then the host syncs
    assert "| GEMM (cuBLAS/CUTLASS) | 300 | 280 | 20 |" in markdown
    assert "| orthogonalization (Triton) | 20 |  |  |" in markdown and "| NCCL |  | 1.5 |  |" in markdown
    assert "| host syncs per step | 1 | 0 | 1 |" in markdown
    other = gpu_proof.build_report({"env": fake_phase("env", values=dict(env, device="NVIDIA H200"))}, ["x"], False)
    gpu_proof.write_report(str(tmp_path / "h200"), other)
    with pytest.raises(ValueError, match="different devices"):
        gpu_proof.merge_reports(paths + [str(tmp_path / "h200" / "report.json")])


def train_report(method, steady, flags=None):
    """A report of one train command whose main run is `method` (with `flags`; None: a report
    written before runs had flags, without the flags column)."""
    name = gpu_proof.run_name(method, (flags or "").split())
    main = dict(ns_method=method, steady_ms=steady, exit=0, **({} if flags is None else {"name": name}))
    phase = fake_phase("train", values={"main": main, f"run_{name}": dict(steady_ms=steady)})
    columns, row = ["run", "ns_method"], ["main", method]
    if flags is not None:
        columns, row = columns + ["flags"], row + [flags]
    phase["tables"] = [{"title": "Training runs of train_gpt.py", "columns": columns, "rows": [row]}]
    return gpu_proof.build_report({"train": phase}, [method], False)


def written(tmp_path, *reports):
    paths = []
    for i, report in enumerate(reports):
        gpu_proof.write_report(str(tmp_path / str(i)), report)
        paths.append(str(tmp_path / str(i) / "report.json"))
    return paths


def test_merge_names_a_file_that_is_not_a_report(tmp_path):
    (tmp_path / "list.json").write_text("[1]")
    for path, why in ((ROOT / "README.md", "Expecting value"), (tmp_path / "list.json", "no meta")):
        result = run("--merge", str(path), "--out", str(tmp_path / "merged"))
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert f"--merge: {path}: not a report.json of gpu_proof.py" in result.stderr and why in result.stderr
    assert not (tmp_path / "merged").exists()


def test_merge_keeps_cpu_smoke_reports_out_of_records_gpu_proof(tmp_path):
    """records/gpu_proof holds GPU proofs (its newest folder is the latest one): a smoke report
    merges only into a folder named elsewhere."""
    env = {"device": "cpu", "train_gpt_sha256": "ab"}
    gpu = gpu_proof.build_report({"env": fake_phase("env", values=env)}, ["cmd1"], False)
    smoke = dict(gpu_proof.build_report({"train": fake_phase("train")}, ["cmd2"], True), created="2000-01-01T00:00:00")
    paths = written(tmp_path, gpu, smoke)
    default_out = ROOT / "records" / "gpu_proof" / "2000-01-01_cpu"
    assert not default_out.exists()
    try:
        for out in ([], ["--out", str(ROOT / "records" / "gpu_proof" / "smoke")]):
            result = run("--merge", *paths, *out)
            assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
            assert f"--merge: {paths[1]} is a --cpu-smoke report" in result.stderr and "--out" in result.stderr
            assert not default_out.exists() and not (ROOT / "records" / "gpu_proof" / "smoke").exists()
    finally:   # what the old code wrote
        for folder in (default_out, ROOT / "records" / "gpu_proof" / "smoke"):
            if folder.exists():
                shutil.rmtree(folder)
    result = run("--merge", *paths, "--out", str(tmp_path / "merged"))
    assert result.returncode == 0, result.stderr
    assert "CPU smoke run" in (tmp_path / "merged" / "report.md").read_text()


def test_merge_adds_a_later_train_run_and_keeps_the_first_main_run(tmp_path):
    paths = written(tmp_path, train_report("newton_schulz", 800.0), train_report("aol", 790.0))
    train = gpu_proof.merge_reports(paths)["phases"]["train"]
    assert train["values"]["main"]["ns_method"] == "newton_schulz"
    assert set(train["values"]) == {"main", "run_newton_schulz", "run_aol"}
    assert train["tables"][0]["rows"] == [["main", "newton_schulz"], ["ns_method", "aol"]]
    rerun = gpu_proof.merge_reports(paths[:1] + paths[:1])["phases"]["train"]   # the same method again: replaces
    assert rerun["tables"][0]["rows"] == [["main", "newton_schulz"]]


def test_merge_keeps_a_phase_a_later_command_skipped(tmp_path):
    """A lease's --total may skip a phase an earlier command ran: the merge keeps the one that ran."""
    skipped = dict(fake_phase("train", "skipped"), skipped="10 s left of --total=300")
    paths = written(tmp_path, train_report("newton_schulz", 800.0), gpu_proof.build_report({"train": skipped}, ["c"], False))
    train = gpu_proof.merge_reports(paths)["phases"]["train"]
    assert train["status"] == "ok" and train["values"]["main"]["steady_ms"] == 800.0
    assert gpu_proof.merge_reports(paths[1:])["phases"]["train"]["status"] == "skipped"   # alone, it stays


def test_merge_adds_a_later_run_with_other_main_flags_as_a_variant(tmp_path):
    """The command a budget note gives for a left-out variant (--main-flags FLAGS --variants '')
    makes a report whose main run merges in as a variant of the first command's main run."""
    paths = written(tmp_path, train_report("newton_schulz", 800.0, ""),
                    train_report("newton_schulz", 830.0, "--compile_scope blocks"))
    train = gpu_proof.merge_reports(paths)["phases"]["train"]
    assert train["values"]["main"]["steady_ms"] == 800.0
    assert set(train["values"]) == {"main", "run_newton_schulz", "run_newton_schulz_compile_scope-blocks"}
    assert train["tables"][0]["rows"] == [["main", "newton_schulz", ""],
                                          ["variant", "newton_schulz", "--compile_scope blocks"]]


def test_merge_keeps_the_main_runs_profile_beside_the_comparison(tmp_path):
    """bench/README.md's second and third commands both profile their main run: the merged comparison
    shows the first's (the preset's) profile, and the later one keeps its own table."""
    reports = [train_report("newton_schulz", 800.0, ""), train_report("newton_schulz", 830.0, "--compile_scope blocks")]
    for report, gemm in zip(reports, (300.0, 310.0)):
        train = report["phases"]["train"]
        train["values"]["profile_ours"] = dict(steps=[13, 15], host_syncs_per_step=0.0,
                                               device_ms_per_step={"GEMM (cuBLAS/CUTLASS)": [gemm, 90.0]})
        train["tables"].append({"title": f"Profile of ours ({train['values']['main']['name']}) over timed steps 13..15",
                                "columns": ["kernel family", "ms/step", "calls/step"],
                                "rows": [["GEMM (cuBLAS/CUTLASS)", gemm, 90.0]]})
    train = gpu_proof.merge_reports(written(tmp_path, *reports))["phases"]["train"]
    assert train["values"]["profile_ours"]["device_ms_per_step"]["GEMM (cuBLAS/CUTLASS)"][0] == 300.0
    profiles = [t for t in train["tables"] if t["title"].startswith("Profile of ours")]
    assert [t["rows"][0][1] for t in profiles] == [300.0, 310.0] and "compile_scope-blocks" in profiles[1]["title"]


def test_merge_names_each_commands_code_when_a_fix_came_between(tmp_path):
    paths = []
    for i, (phase, sha) in enumerate((("correct", "a" * 64), ("train", "b" * 64), ("peer", "b" * 64))):
        report = gpu_proof.build_report({phase: fake_phase(phase)}, [f"cmd{i}"], False)
        report["meta"].update(train_gpt_sha256=sha, git_commit="c" * 40)
        gpu_proof.write_report(str(tmp_path / str(i)), report)
        paths.append(str(tmp_path / str(i) / "report.json"))
    merged = gpu_proof.merge_reports(paths)
    assert merged["commands"] == [f"cmd{i}    # train_gpt.py sha256 {s * 16}, git {'c' * 12}"
                                  for i, s in enumerate("abb")]
    assert merged["meta"]["train_gpt_sha256"].startswith("several")
    gpu_proof.write_report(str(tmp_path / "merged"), merged)
    assert "from train_gpt.py as each command names," in (tmp_path / "merged" / "report.md").read_text()
    gpu_proof.write_report(str(tmp_path / "m"), merged)   # merged again with a later command: labels once
    again = gpu_proof.merge_reports([str(tmp_path / "m" / "report.json"), paths[2]])
    assert again["commands"] == merged["commands"] + [merged["commands"][2]]
    same = gpu_proof.merge_reports(paths[1:])
    assert same["commands"] == ["cmd1", "cmd2"] and same["meta"]["train_gpt_sha256"] == "b" * 64


def test_orthogonalize_check_stacks_tiny_matrices_enough_to_be_stable(monkeypatch):
    """The correct phase bounds Triton's aol error by 1.5x the twin's. The two differ only in the
    Schur row sums (the kernel's from the fp32 Gram, the twin's from the bf16-rounded one); on
    6x12 matrices that alone swings single draws of four past 1.5x, so the check stacks enough
    of them: here, with bf16 emulated on CPU, the ratio of the two errors stays well inside."""
    import torch
    tg = gpu_proof.import_trainer()
    stack = max(4, gpu_proof.ORTHO_MIN_ROWS // 6)
    gen = torch.Generator().manual_seed(0)
    ratios = []
    for _ in range(6):
        G = torch.randn(stack, 6, 12, generator=gen).bfloat16().float()
        ref = tg.orthogonalize_torch(G.double(), "aol")
        twin = tg.orthogonalize_torch(G, "aol", round_through=torch.bfloat16)
        fp32_sums = (G @ G.mT).abs().sum(-1)
        with monkeypatch.context() as patch:
            row_scale = tg._first_step_row_scale
            patch.setattr(tg, "_first_step_row_scale", lambda method, A, sums=None: row_scale(method, A, fp32_sums))
            kernel_like = tg.orthogonalize_torch(G, "aol", round_through=torch.bfloat16)
        err = lambda out: float((out.double() - ref).norm() / ref.norm())  # noqa: E731
        assert not torch.equal(kernel_like, twin)  # the row sums do differ
        ratios.append(err(kernel_like) / err(twin))
    assert 0.75 < min(ratios) and max(ratios) < 1.3, ratios
