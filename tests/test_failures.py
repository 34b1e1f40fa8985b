"""Runs that go wrong after set-up end in one line, a complete log and a documented exit code:
divergence, SIGINT/SIGTERM (one process and a torchrun group), a log that cannot be written."""

import errno
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import train_gpt
from harness import checkpoints as ckpt, config as cfg, launch as launcher
from conftest import ROOT, TINY, before_summary, sigint_as_at_a_terminal, tiny_argv

pytestmark = pytest.mark.slow  # launches fresh processes: the full suite only (README, Test)

PEAK = re.compile(r"^peak memory allocated: \d+ MiB reserved: \d+ MiB$")


def only_log(log_dir):
    logs = list(log_dir.glob("*/*.txt"))
    assert len(logs) == 1, logs
    return logs[0].read_text()


# ------------------------------------------------------------------------------ divergence

def poisoned_run(make_shards, at_step, **overrides):
    """In-process training whose weights become nan after step at_step (a stand-in for divergence)."""
    train_glob, val_glob, _ = make_shards()
    args = train_gpt.Hyperparameters(**dict(TINY, train_files=train_glob, val_files=val_glob, **overrides))
    cfg.check_config(args, 1, False)
    lines = []

    def poison(step, model, optimizer):
        if step == at_step:
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))
    result = train_gpt.train(args, train_gpt.Ranks(), train_gpt.Hardware.detect(args),
                             lambda text, console=True: lines.append(text), on_step=poison)
    return result, lines


def test_keyboard_interrupt_without_signal_handlers_closes_the_loader(make_shards, monkeypatch):
    """train() called directly (tests, bench scripts): Ctrl-C propagates, and the prefetch thread
    is shut down on the way out."""
    train_glob, val_glob, _ = make_shards()
    args = train_gpt.Hyperparameters(**dict(TINY, train_files=train_glob, val_files=val_glob, num_iterations=5))
    closed = []
    close = train_gpt.PackedBatches.close  # TINY's loader (packed documents), as the preset's
    monkeypatch.setattr(train_gpt.PackedBatches, "close", lambda self: closed.append(self) or close(self))

    def interrupt(step, model, optimizer):
        if step == 2:
            raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):
        train_gpt.train(args, train_gpt.Ranks(), train_gpt.Hardware.detect(args), lambda *a, **k: None,
                        on_step=interrupt)
    assert len(closed) == 1


def test_nonfinite_train_loss_stops_at_the_next_check_naming_the_step(make_shards):
    result, lines = poisoned_run(make_shards, at_step=2, num_iterations=12, val_every=0, check_every=4)
    # step 3 is the first with a nan loss; it is found at the check after step 4, not earlier
    assert result.failure == "diverged at step 3/12: train loss is nan (stopped at step 4)"
    assert result.exit_code == train_gpt.EXIT_DIVERGED and result.steps_done == 4
    assert lines[-2] == result.failure and PEAK.match(lines[-1])
    assert not any(line.startswith("step:") and "val_loss" in line for line in lines)  # none of a diverged model


def test_nonfinite_val_loss_stops_the_run(make_shards):
    # weights nan right after step 2's loss: the check before the validation sees finite losses
    result, lines = poisoned_run(make_shards, at_step=2, num_iterations=12, val_every=2, check_every=100)
    assert result.failure == "diverged at step 2/12: val_loss is nan"
    assert result.exit_code == train_gpt.EXIT_DIVERGED and result.steps_done == 2
    assert lines[-3].startswith("step:2/12 val_loss:nan") and PEAK.match(lines[-1])


def test_a_val_loss_above_step_0s_stops_the_run_as_diverged(make_shards):
    """`./run.sh --num_iterations 30 --adam_lr 1e10` ended at val loss 22.11 with exit 0: a finite
    val loss more than a nat above the untrained model's (step 0's, near ln(vocab)) is divergence."""
    def blow_up(step, model, optimizer):  # logits far from uniform: the loss climbs, finite (soft cap)
        if step == 3:
            with torch.no_grad():
                model.lm_head_w.normal_(0, 10, generator=torch.Generator().manual_seed(0))
    train_glob, val_glob, _ = make_shards()
    args = train_gpt.Hyperparameters(**dict(TINY, train_files=train_glob, val_files=val_glob, num_iterations=8,
                                            val_every=2))
    lines = []
    result = train_gpt.train(args, train_gpt.Ranks(), train_gpt.Hardware.detect(args),
                             lambda text, console=True: lines.append(text), on_step=blow_up)
    (_, first), (_, second), (_, third) = result.val_losses
    assert second < first < first + 1 < third and math.isfinite(third)
    assert result.failure == f"diverged at step 4/8: val_loss is {third:.4f}, more than a nat above step 0's {first:.4f}"
    assert result.exit_code == train_gpt.EXIT_DIVERGED and result.steps_done == 4
    assert lines[-2] == result.failure and PEAK.match(lines[-1])


def test_a_val_loss_less_than_a_nat_above_step_0s_goes_on(make_shards):
    """A healthy run may wander a little above the untrained model's loss in its first steps (under
    init 2026 step 0 is already below ln(vocab)): here a head zeroed before step 4's validation
    (uniform logits: ln(vocab)) is not divergence."""
    def flatten(step, model, optimizer):
        if step == 4:
            with torch.no_grad():
                model.lm_head_w.zero_()
    train_glob, val_glob, _ = make_shards()
    args = train_gpt.Hyperparameters(**dict(TINY, train_files=train_glob, val_files=val_glob, num_iterations=6,
                                            val_every=2))
    result = train_gpt.train(args, train_gpt.Ranks(), train_gpt.Hardware.detect(args),
                             lambda text, console=True: None, on_step=flatten)
    (_, first), _, (_, third), _ = result.val_losses
    assert third == pytest.approx(math.log(50304), abs=1e-4) and first < third < first + 1
    assert result.failure is None and result.steps_done == 6


def test_nonfinite_train_loss_is_found_before_a_validation_not_by_it(make_shards):
    """A validation step that is no check step (the speedrun's 125 and 10) checks the losses first:
    a diverged model's validation would cost 10M tokens and name a later step."""
    result, lines = poisoned_run(make_shards, at_step=1, num_iterations=12, val_every=3, check_every=100)
    assert result.failure == "diverged at step 2/12: train loss is nan (stopped at step 3)"
    assert result.exit_code == train_gpt.EXIT_DIVERGED and result.steps_done == 3
    assert not any("val_loss" in line for line in lines if line.startswith("step:3/"))


def test_a_diverged_model_never_replaces_the_last_checkpoint(tmp_path, make_shards, monkeypatch, capsys):
    """The update of step 6 leaves the weights nan while its loss, taken before the update, is finite:
    the checkpoint due after step 6 checks the weights, writes nothing, and step 4's stays
    (checkpoints every 2 steps: a multiple of adam_every)."""
    train_glob, val_glob, _ = make_shards()
    log_dir = tmp_path / "records"
    lr_factor_at = train_gpt.lr_factor_at
    monkeypatch.setattr(train_gpt, "lr_factor_at", lambda step, args: float("nan") if step >= 5
                        else lr_factor_at(step, args))
    argv = tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=log_dir, num_iterations=8, val_every=0,
                     check_every=100, save_checkpoint=True, checkpoint_every=2)
    assert train_gpt.main(argv, {}) == train_gpt.EXIT_DIVERGED
    body = only_log(log_dir).splitlines()
    assert body[-2] == "diverged at step 6/8: a weight is nan or inf (no checkpoint written)"
    assert [line.split(" saved")[0] for line in body if line.startswith("checkpoint:")] == [
        "checkpoint: step 2", "checkpoint: step 4"]
    (path,) = log_dir.glob("*/*.pt")
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    assert checkpoint["step"] == 4 and all(v.isfinite().all() for v in checkpoint["model"].values())


def test_diverged_run_exits_4_with_one_line_and_a_complete_log(tmp_path, make_shards, monkeypatch, capsys):
    train_glob, val_glob, _ = make_shards()
    log_dir = tmp_path / "records"
    monkeypatch.setattr(train_gpt, "lr_factor_at", lambda step, args: float("nan"))  # nan weights after step 1
    argv = tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=log_dir, num_iterations=20, val_every=0,
                     check_every=5)
    handler_before = signal.getsignal(signal.SIGINT)  # pytest's; SIG_IGN where pytest was started in the background
    assert train_gpt.main(argv, {}) == train_gpt.EXIT_DIVERGED == 4
    body = only_log(log_dir).splitlines()
    assert body[-2] == "diverged at step 2/20: train loss is nan (stopped at step 5)"
    assert PEAK.match(body[-1])
    out = capsys.readouterr().out
    assert before_summary(out)[-2:] == body[-2:]
    assert out.splitlines()[-1].startswith("stopped at step 5/20: target 6.0 not reached; train time ")  # no verdict
    assert signal.getsignal(signal.SIGINT) is handler_before  # main() put the caller's handler back


def test_exception_late_in_training_ends_in_one_line_and_a_complete_log(tmp_path, make_shards, monkeypatch, capsys):
    """Out of memory at step 4 (or a lost rank, or a bug in a fork): the log keeps the traceback and
    ends like every other stopped run; the console gets one line."""
    train_glob, val_glob, _ = make_shards()
    log_dir = tmp_path / "records"
    schedule = train_gpt.lr_factor_at

    def out_of_memory_at_step_4(step, args):
        if step == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB.\nMore details")
        return schedule(step, args)
    monkeypatch.setattr(train_gpt, "lr_factor_at", out_of_memory_at_step_4)
    argv = tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=log_dir, num_iterations=20, val_every=0)
    assert train_gpt.main(argv, {}) == train_gpt.EXIT_ERROR
    log = only_log(log_dir)
    body = log.splitlines()
    assert body[-3] == "More details"  # the end of the traceback
    assert "step:3/20 train_time" in log and "step:4/20" not in log
    assert body[-2] == "failed at step 3/20: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB."
    assert PEAK.match(body[-1])
    assert "Traceback (most recent call last)" in log and "More details" in log
    out, err = capsys.readouterr()
    path = next(log_dir.glob("*/*.txt"))
    assert err == f"train_gpt.py: error: {body[-2]} (traceback in {path})\n"
    assert before_summary(out)[-1] == body[-1] and "Traceback" not in out


def test_a_bug_found_in_warmup_ends_in_one_line_and_a_complete_log(tmp_path, make_shards, monkeypatch, capsys):
    """A fork's bug in forward (or a compiler error, or out of memory) shows first in warmup: it
    ends as a failure in the loop does, not in a bare traceback after a log cut off at warmup."""
    train_glob, val_glob, _ = make_shards()
    log_dir = tmp_path / "records"

    def buggy_forward(self, x):
        raise RuntimeError("approximate argument must be either none or tanh")
    monkeypatch.setattr(train_gpt.MLP, "forward", buggy_forward)
    argv = tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=log_dir, warmup_steps=2)
    assert train_gpt.main(argv, {}) == train_gpt.EXIT_ERROR
    body = only_log(log_dir).splitlines()
    assert "Warming up kernels" in body and "Traceback (most recent call last):" in body
    assert body[-2] == ("failed at step 0/4: RuntimeError: approximate argument must be either none or tanh")
    assert PEAK.match(body[-1])
    out, err = capsys.readouterr()
    assert err == f"train_gpt.py: error: {body[-2]} (traceback in {next(log_dir.glob('*/*.txt'))})\n"
    assert "Traceback" not in out


def test_a_signal_the_compiler_wraps_in_warmup_is_still_an_interruption(tmp_path, make_shards, monkeypatch, capsys):
    """torch.compile re-raises what its tracing met (the handler's Interrupted) as errors of its own."""
    train_glob, val_glob, _ = make_shards()
    log_dir = tmp_path / "records"

    def forward_compiling(self, x):
        try:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: main()'s handler raises Interrupted here
            time.sleep(5)
        except launcher.Interrupted as e:
            raise RuntimeError("the compiler's own error") from e
    monkeypatch.setattr(train_gpt.MLP, "forward", forward_compiling)
    argv = tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=log_dir, warmup_steps=2)
    assert train_gpt.main(argv, {}) == 128 + signal.SIGINT
    body = only_log(log_dir).splitlines()
    assert body[-2] == "interrupted at step 0/4 (SIGINT)" and PEAK.match(body[-1])
    assert "Traceback" not in "\n".join(body) and capsys.readouterr().err == ""


def test_bad_shard_found_in_the_loop_is_a_data_error_not_a_crash(tmp_path, make_shards, monkeypatch, capsys):
    train_glob, val_glob, _ = make_shards()
    log_dir = tmp_path / "records"
    calls = []

    def unreadable(self, device, seq_len):
        calls.append(1)
        raise train_gpt.DataError("fineweb_train_000002.bin: cannot read (Input/output error)")
    monkeypatch.setattr(train_gpt.PackedBatches, "next_batch", unreadable)
    argv = tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=log_dir, num_iterations=20, val_every=0)
    assert train_gpt.main(argv, {}) == train_gpt.EXIT_ERROR and calls
    assert capsys.readouterr().err == "train_gpt.py: error: fineweb_train_000002.bin: cannot read (Input/output error)\n"
    body = only_log(log_dir).splitlines()  # the log ends like every other stopped run's
    assert body[-2] == "fineweb_train_000002.bin: cannot read (Input/output error)" and PEAK.match(body[-1])
    assert "Traceback" not in body[-5:]


def test_bad_shard_found_by_one_rank_in_the_loop_is_named_by_that_rank(make_shards, monkeypatch):
    """Ranks read their own windows: an I/O error may hit one rank only. That rank says so (rank 0's
    console line alone would only say that a peer is gone) and touches no collective after it."""
    train_glob, val_glob, _ = make_shards()
    args = train_gpt.Hyperparameters(**dict(TINY, train_files=train_glob, val_files=val_glob, num_iterations=8,
                                            val_every=0, micro_batches=2))
    cfg.check_config(args, 2, False)
    collectives, at_failure = [], []

    def unreadable(self, device, seq_len):
        at_failure.append(len(collectives))
        raise train_gpt.DataError("fineweb_train_000002.bin: cannot read (Input/output error)")
    lines = []
    monkeypatch.setattr(train_gpt.PackedBatches, "next_batch", unreadable)
    monkeypatch.setattr(train_gpt.dist, "all_reduce", lambda *a, **k: collectives.append(a))
    result = train_gpt.train(args, train_gpt.Ranks(1, 1, 2, 2), train_gpt.Hardware.detect(args),
                             lambda text, console=True: lines.append(text))
    assert result.crashed and not result.traceback_logged and result.exit_code == train_gpt.EXIT_ERROR
    assert result.failure == "rank 1: fineweb_train_000002.bin: cannot read (Input/output error)"
    assert lines[-2] == result.failure and PEAK.match(lines[-1])
    assert at_failure and len(collectives) == at_failure[0]  # no final all_reduce of the losses


def test_a_signal_at_a_checkpoint_step_writes_that_checkpoint_first(tmp_path, make_shards, monkeypatch, capsys):
    """Ctrl-C during the step that ends at a checkpoint step: the checkpoint (the step's check, of
    finite losses and weights) is written, then the run stops there; --resume goes on from it."""
    train_glob, val_glob, _ = make_shards()
    log_dir = tmp_path / "records"
    lr_factor_at = train_gpt.lr_factor_at

    def ctrl_c_in_step_3(step, args):
        if step == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return lr_factor_at(step, args)
    monkeypatch.setattr(train_gpt, "lr_factor_at", ctrl_c_in_step_3)
    argv = tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=log_dir, num_iterations=8, val_every=0,
                     check_every=100, save_checkpoint=True, checkpoint_every=2)
    assert train_gpt.main(argv, {}) == 128 + signal.SIGINT
    body = only_log(log_dir).splitlines()
    (path,) = log_dir.glob("*/*.pt")
    assert [line.split(" saved")[0] for line in body if line.startswith("checkpoint:")] == [
        "checkpoint: step 2", "checkpoint: step 4"]
    assert body[-3].startswith(f"last checkpoint: step 4, {path}") and body[-2] == "interrupted at step 4/8 (SIGINT)"
    assert torch.load(path, map_location="cpu", weights_only=True)["step"] == 4


def test_each_step_is_checked_once(tmp_path, make_shards):
    """The checks of a run (step, weights too): check_every 4, a validation at 5 (checked first), a
    checkpoint at 4 (its check is the step's), the last step 6; none twice at one step but step 0,
    checked before warmup (the log's header) and again after it."""
    train_glob, val_glob, _ = make_shards()
    argv = tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=tmp_path / "records", num_iterations=6,
                     val_every=5, check_every=4, save_checkpoint=True, checkpoint_every=4, warmup_steps=1)
    checks = []

    def record_checks(frame, event, arg):  # a trace function sees Python calls alone (no C calls): cheap
        if event == "call" and frame.f_code.co_name == "check" and frame.f_code.co_filename == train_gpt.__file__:
            checks.append((frame.f_locals["step"], frame.f_locals["weights"]))
    sys.settrace(record_checks)
    try:
        assert train_gpt.main(argv, {}) == 0
    finally:
        sys.settrace(None)
    assert checks == [(0, False), (0, False), (4, True), (5, False), (6, False)]


def test_out_of_memory_while_building_the_model_is_one_line(tmp_path, make_shards, monkeypatch, capsys):
    """The model and the optimizer state are built in the set-up (where a larger fork runs out of
    memory): one line after the traceback, exit 1, no log begun."""
    train_glob, val_glob, _ = make_shards()

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    monkeypatch.setattr(train_gpt, "GPT", out_of_memory)
    argv = tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=tmp_path / "records")
    assert train_gpt.main(argv, {}) == train_gpt.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last)") and err.splitlines()[-1] == (
        "train_gpt.py: error: failed in set-up: OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 GiB")
    assert not (tmp_path / "records").exists()


def test_crash_without_a_log_file_prints_its_traceback(make_shards, capsys):
    """A rank other than 0 has no log: its traceback goes to stderr, before main()'s one line."""
    train_glob, val_glob, _ = make_shards()
    args = train_gpt.Hyperparameters(**dict(TINY, train_files=train_glob, val_files=val_glob, num_iterations=8,
                                            val_every=0))
    cfg.check_config(args, 1, False)

    def bug(step, model, optimizer):
        if step == 2:
            raise KeyError("bug")
    lines = []
    result = train_gpt.train(args, train_gpt.Ranks(), train_gpt.Hardware.detect(args),
                             lambda text, console=True: lines.append(text), on_step=bug)
    assert result.crashed and result.exit_code == train_gpt.EXIT_ERROR and result.train_losses == []
    assert result.failure == "failed at step 2/8: KeyError: 'bug'" == lines[-2] and PEAK.match(lines[-1])
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last)") and err.rstrip().endswith("KeyError: 'bug'")


# ------------------------------------------------------------------------------ signals

def start(tmp_path, argv, command=(sys.executable, str(ROOT / "train_gpt.py")), sighup=signal.SIG_DFL, **variables):
    """sighup: the disposition the run inherits (SIG_IGN: started under nohup); not the tests' own."""
    launch_variables = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NPROC", "MICRO_BATCHES")
    env = {k: v for k, v in os.environ.items() if k not in launch_variables}
    env.update(OMP_NUM_THREADS="1", PYTHON=sys.executable, **variables)
    # a session of its own: killpg reaches every process, as Ctrl-C in a terminal does
    return subprocess.Popen([*command, *argv], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, sighup))


def wait_for_line(proc, pattern, timeout=120):
    seen = []
    deadline = time.time() + timeout
    while time.time() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line.rstrip("\n"))
        if re.search(pattern, line):
            return seen
    proc.kill()
    pytest.fail(f"never printed {pattern!r}; output: {seen[-20:]} {proc.stderr.read()[-2000:]}")


@pytest.mark.parametrize("signum, wait_for, step", [
    (signal.SIGINT, r"^step:2/1000 train_time", r"\d+"),
    (signal.SIGTERM, r"^step:2/1000 train_time", r"\d+"),
    (signal.SIGTERM, r"^Warming up kernels", "0"),  # outside the loop: at once
    (signal.SIGHUP, r"^step:2/1000 train_time", r"\d+"),  # a closed terminal: it killed the run without a line
])
def test_signal_ends_the_run_with_one_line(tmp_path, make_shards, signum, wait_for, step):
    train_glob, val_glob, _ = make_shards()
    log_dir = tmp_path / "records"
    warmup = 0 if "step" in wait_for else 10_000
    proc = start(tmp_path, tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=log_dir,
                                     num_iterations=1000, val_every=0, warmup_steps=warmup))
    wait_for_line(proc, wait_for)
    os.killpg(proc.pid, signum)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signum, err[-3000:]
    assert err == ""  # no traceback
    name = signal.Signals(signum).name
    last = before_summary(out)[-2:]
    assert re.fullmatch(rf"interrupted at step {step}/1000 \({name}\)", last[0]) and PEAK.match(last[1])
    assert only_log(log_dir).splitlines()[-2:] == last


def test_a_terminal_closed_under_the_run_ends_it_in_one_line_in_the_log(tmp_path, make_shards):
    """A terminal that closes hangs up: writes to it fail with EIO, and SIGHUP comes. The run ends
    as for SIGHUP, its last line and the log's end written, the console's EIO no error."""
    import pty
    import select
    train_glob, val_glob, _ = make_shards()
    log_dir = tmp_path / "records"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    terminal, console = pty.openpty()
    proc = subprocess.Popen([sys.executable, str(ROOT / "train_gpt.py"),
                             *tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=log_dir,
                                        num_iterations=1000, val_every=0, warmup_steps=0)],
                            cwd=tmp_path, env=dict(env, OMP_NUM_THREADS="1"), stdin=subprocess.DEVNULL,
                            stdout=console, stderr=console, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_DFL))
    os.close(console)
    shown, deadline = b"", time.time() + 120
    while b"step:3/1000 train_time" not in shown and time.time() < deadline and proc.poll() is None:
        if select.select([terminal], [], [], 1)[0]:
            shown += os.read(terminal, 65536)
    assert b"step:3/1000 train_time" in shown, shown[-2000:]
    os.close(terminal)  # the terminal window closes: the run's next console write fails with EIO
    time.sleep(1)       # (steps go on meanwhile, their lines to the closed terminal)
    os.killpg(proc.pid, signal.SIGHUP)
    assert proc.wait(timeout=60) == 128 + signal.SIGHUP
    last = only_log(log_dir).splitlines()[-2:]
    assert re.fullmatch(r"interrupted at step \d+/1000 \(SIGHUP\)", last[0]) and PEAK.match(last[1]), last


def test_under_nohup_a_sighup_leaves_the_run_going(tmp_path, make_shards):
    """nohup ignores SIGHUP so that a run outlives its terminal: train_gpt.py keeps it ignored
    (watching it as it watches SIGTERM would end the run at logout)."""
    train_glob, val_glob, _ = make_shards()
    log_dir = tmp_path / "records"
    proc = start(tmp_path, tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=log_dir,
                                     num_iterations=8, val_every=0), sighup=signal.SIG_IGN)
    wait_for_line(proc, r"^step:2/8 train_time")
    os.killpg(proc.pid, signal.SIGHUP)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0 and err == "", err[-3000:]
    assert "SIGHUP" not in out and re.search(r"^step:8/8 val_loss", only_log(log_dir), re.M)


@pytest.mark.parametrize("command", [(sys.executable, str(ROOT / "train_gpt.py")), (str(ROOT / "run.sh"),)],
                         ids=["train_gpt.py", "run.sh"])
def test_ctrl_c_while_torch_loads_ends_without_a_traceback(tmp_path, command):
    """The first second or two go to importing torch (run.sh: to asking it for the GPU count),
    before main() watches signals: Ctrl-C there ends the program as it ends any command."""
    proc = subprocess.Popen(command, cwd=tmp_path, env=dict(os.environ, PYTHON=sys.executable),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=sigint_as_at_a_terminal)
    time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode in (-signal.SIGINT, 128 + signal.SIGINT) and err == "", err[-2000:]
    assert out == ""  # before the trainer's own handler, which would say "interrupted at step 0/..."


def test_ctrl_c_that_also_ends_a_tee_still_ends_in_one_line_and_a_complete_log(tmp_path, make_shards):
    """`./run.sh | tee out.txt`: the same Ctrl-C ends tee, and the run's console is gone."""
    train_glob, val_glob, _ = make_shards()
    log_dir = tmp_path / "records"
    proc = start(tmp_path, tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=log_dir,
                                     num_iterations=1000, val_every=0))
    wait_for_line(proc, r"^step:2/1000 train_time")
    proc.stdout.close()  # the reader has gone
    os.killpg(proc.pid, signal.SIGINT)
    err = proc.stderr.read()
    assert proc.wait(timeout=60) == 130 and err == "", err[-3000:]
    last = only_log(log_dir).splitlines()[-2:]
    assert re.fullmatch(r"interrupted at step \d+/1000 \(SIGINT\)", last[0]) and PEAK.match(last[1])


def test_a_rank_dies_with_its_launcher(tmp_path):
    """torchrun killed (or ended by a third Ctrl-C, which no longer waits for its processes) must
    not leave its ranks holding their GPUs."""
    rank = ("import sys, time; sys.path.insert(0, sys.argv[1]); from harness import launch; "
            "launch.die_with_the_launcher({'TORCHELASTIC_RUN_ID': 'x'}); print('ready', flush=True); time.sleep(60)")
    launcher = ("import subprocess, sys, time; "
                f"child = subprocess.Popen([sys.executable, '-c', {rank!r}, {str(ROOT)!r}]); "
                "print(child.pid, flush=True); time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    assert proc.stdout.readline() == "ready\n"
    proc.kill()
    proc.wait()
    deadline = time.time() + 10
    state = lambda: Path(f"/proc/{child}/stat").read_text().split()[2] if Path(f"/proc/{child}").exists() else "gone"
    while state() not in ("gone", "Z") and time.time() < deadline:
        time.sleep(0.1)
    assert state() in ("gone", "Z")


def test_interrupting_a_torchrun_group_stops_every_rank_at_the_same_step(tmp_path, make_shards):
    train_glob, val_glob, _ = make_shards()
    log_dir = tmp_path / "records"
    proc = start(tmp_path, tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=log_dir, micro_batches=2,
                                     num_iterations=1000, val_every=0, check_every=2, dist_timeout_s=30),
                 command=(str(ROOT / "run.sh"),), NPROC="2")
    wait_for_line(proc, r"^step:2/1000 train_time")
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals torchrun and both ranks
    out, err = proc.communicate(timeout=60)
    # as one process: status 130, no traceback (torchrun's own is caught by run.sh), and none is
    # left running (torchrun would SIGKILL a rank that ignored the signal for 30 s)
    assert proc.returncode == 130 and err == "", err[-3000:]
    with pytest.raises(ProcessLookupError):
        os.killpg(proc.pid, 0)
    last = only_log(log_dir).splitlines()[-2:]
    assert re.fullmatch(r"interrupted at step \d*[02468]/1000 \(SIGINT\)", last[0]) and PEAK.match(last[1])
    assert before_summary(out)[-2:] == last


def test_interrupting_a_torchrun_group_during_warmup_reports_once(tmp_path, make_shards):
    train_glob, val_glob, _ = make_shards()
    proc = start(tmp_path, tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=tmp_path / "records",
                                     micro_batches=2, warmup_steps=10_000, dist_timeout_s=30),
                 command=(str(ROOT / "run.sh"),), NPROC="2")
    wait_for_line(proc, r"^Warming up kernels")
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and err == "", err[-3000:]
    assert out.count("interrupted at step 0/") == 1 and out.count("peak memory") == 1, out[-2000:]


def test_rank_killed_by_a_signal_is_named_in_one_line(tmp_path, make_shards):
    """A rank the kernel kills (the OOM killer's SIGKILL) cannot say why itself: run.sh does."""
    train_glob, val_glob, _ = make_shards()
    proc = start(tmp_path, tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=tmp_path / "records",
                                     micro_batches=2, num_iterations=1000, val_every=0, dist_timeout_s=30),
                 command=(str(ROOT / "run.sh"),), NPROC="2")
    wait_for_line(proc, r"^step:2/1000 train_time")
    ranks = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert len(ranks) == 2, ranks
    os.kill(int(max(ranks, key=int)), signal.SIGKILL)  # rank 1, started second
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGKILL
    # rank 0 may first find its partner gone (one line of its own), or be stopped by torchrun
    *before, last = err.strip().splitlines()
    assert re.fullmatch(r"run\.sh: rank 1 was killed by SIGKILL \(out of memory\?\)", last), err[-3000:]
    assert all(line.startswith("train_gpt.py: error: rank 0: failed at step ") for line in before), err[-3000:]
    body = only_log(tmp_path / "records").splitlines()
    assert re.match(r"(rank 0: failed|interrupted) at step \d+/1000", body[-2]) and PEAK.match(body[-1]), body[-3:]


def signalled_in_process(tmp_path, make_shards, monkeypatch, where, call, pause_s, then=signal.SIGINT):
    """main() in this process, sent SIGINT and then `then`, pause_s apart, from inside the call-th
    call of `where` (a function of train_gpt that the run calls); returns main()'s exit status and
    the log's lines."""
    train_glob, val_glob, _ = make_shards()
    log_dir = tmp_path / "records"
    monkeypatch.setattr(launcher.StopSignals, "FORWARDED_WITHIN_S", 0.2)
    original = getattr(train_gpt, where)
    calls = []

    def signalled(*args):
        calls.append(args)
        if len(calls) == call:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(pause_s)
            os.kill(os.getpid(), then)
        return original(*args)
    monkeypatch.setattr(train_gpt, where, signalled)
    argv = tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=log_dir, num_iterations=8, val_every=0)
    status = train_gpt.main(argv, {})
    assert len(calls) >= call
    return status, only_log(log_dir).splitlines()


def test_ctrl_c_is_acknowledged_at_once_and_a_second_one_stops_the_step(tmp_path, make_shards, monkeypatch, capfd):
    """The first Ctrl-C waits for the next check (seconds on one GPU, minutes under the Triton
    interpreter): the console says so at once, and a second one stops the run mid-step."""
    status, body = signalled_in_process(tmp_path, make_shards, monkeypatch, "lr_factor_at", 3, pause_s=0.3)
    assert status == 130
    assert body[-2] == "interrupted at step 2/8 (SIGINT twice: stopped mid-step)" and PEAK.match(body[-1])
    assert "step:3/8" not in "\n".join(body)
    out, err = capfd.readouterr()
    assert err == ""  # no traceback
    lines = out.splitlines()
    notice = lines.index("SIGINT: the run stops after this step (SIGINT again to stop at once)")
    assert lines[notice - 1].startswith("step:2/8 train_time") and before_summary(out)[-2:] == body[-2:]


def test_a_signal_passed_on_by_a_launcher_is_not_a_second_one(tmp_path, make_shards, monkeypatch, capfd):
    """scancel signals every process of a job, and torchrun passes the same signal on: that copy,
    within FORWARDED_WITHIN_S, leaves the run to stop at its check, after the step."""
    status, body = signalled_in_process(tmp_path, make_shards, monkeypatch, "lr_factor_at", 3, pause_s=0)
    assert status == 130
    assert body[-3].startswith("step:3/8 train_time")
    assert body[-2] == "interrupted at step 3/8 (SIGINT)" and PEAK.match(body[-1])
    assert capfd.readouterr().err == ""


def test_another_signal_soon_after_is_a_second_one(tmp_path, make_shards, monkeypatch, capfd):
    """A second Ctrl-C makes torchrun send SIGTERM to ranks it has sent SIGINT: at once, mid-step."""
    status, body = signalled_in_process(tmp_path, make_shards, monkeypatch, "lr_factor_at", 3, pause_s=0,
                                        then=signal.SIGTERM)
    assert status == 130
    assert body[-2] == "interrupted at step 2/8 (SIGINT then SIGTERM: stopped mid-step)" and PEAK.match(body[-1])
    assert capfd.readouterr().err == ""


def test_ctrl_c_after_the_last_step_changes_nothing(tmp_path, make_shards, monkeypatch, capfd):
    status, body = signalled_in_process(tmp_path, make_shards, monkeypatch, "peak_memory_line", 1, pause_s=0)
    assert status == 0 and PEAK.match(body[-1]) and body[-2].startswith("step:8/8 val_loss:")
    out, err = capfd.readouterr()
    assert err == "" and "SIGINT: the run is ending (SIGINT again to stop at once)" in out.splitlines()


@pytest.mark.parametrize("phase, repeat", [("end", None), ("loop", signal.SIGINT)])
def test_insisting_once_more_takes_the_signals_default_action(monkeypatch, phase, repeat):
    """After the loop, or after a stop mid-step, the clean-up might hang: one more signal ends the
    process the way the signal does by default."""
    done = []
    monkeypatch.setattr(train_gpt.signal, "signal", lambda signum, handler: done.append(("handler", signum, handler)))
    monkeypatch.setattr(train_gpt.os, "kill", lambda pid, signum: done.append(("kill", pid, signum)))
    stop = launcher.StopSignals(announce=False)
    stop.phase, stop.signum, stop.repeat = phase, signal.SIGINT, repeat
    stop(signal.SIGINT, None)
    assert done == [("handler", signal.SIGINT, signal.SIG_DFL), ("kill", os.getpid(), signal.SIGINT)]


def test_a_copy_of_the_second_signal_is_not_a_third(monkeypatch):
    """After Ctrl-C under run.sh, scancel's SIGTERM reaches a rank directly and through torchrun:
    the first stops the loop mid-step, its copy must not kill the rank before its last line."""
    done = []
    monkeypatch.setattr(train_gpt.signal, "signal", lambda signum, handler: done.append(("handler", signum, handler)))
    monkeypatch.setattr(train_gpt.os, "kill", lambda pid, signum: done.append(("kill", pid, signum)))
    stop = launcher.StopSignals(announce=False)
    stop.phase, stop.until_text = "loop", "stops after this step"
    stop(signal.SIGINT, None)
    with pytest.raises(launcher.Interrupted):
        stop(signal.SIGTERM, None)
    stop(signal.SIGTERM, None)  # within FORWARDED_WITHIN_S: ignored, no default action
    assert done == []
    assert (stop.signum, stop.repeat, stop.stopped_mid_step()) == (signal.SIGINT, signal.SIGTERM, "SIGINT then SIGTERM")


@pytest.mark.parametrize("backend, clean, expected", [("nccl", True, "destroy"), ("nccl", False, "abort"),
                                                      ("gloo", False, "destroy"), (None, False, None)])
def test_a_process_group_is_aborted_after_a_run_that_left_collectives_unmatched(monkeypatch, backend, clean,
                                                                                 expected):
    """NCCL's destroy waits for every collective in flight: after a crash or a mid-step stop one that
    no peer matches would hold the rank until torchrun kills it, so the group is aborted there."""
    done = []
    monkeypatch.setattr(train_gpt.dist, "is_initialized", lambda: backend is not None)
    monkeypatch.setattr(train_gpt.dist, "get_backend", lambda: backend)
    monkeypatch.setattr(train_gpt.dist, "destroy_process_group", lambda: done.append("destroy"))
    monkeypatch.setattr(train_gpt.dist.distributed_c10d, "_abort_process_group", lambda: done.append("abort"))
    train_gpt.leave_process_group(clean)
    assert done == ([expected] if expected else [])


@pytest.mark.parametrize("where, call, pause_s, clean", [("peak_memory_line", 1, 0, True),  # acknowledged at the end
                                                          ("lr_factor_at", 3, 0, True),  # stopped at a check
                                                          ("lr_factor_at", 3, 0.3, False)])  # stopped mid-step
def test_only_a_run_whose_ranks_finished_their_steps_leaves_the_group_as_a_clean_one(
        tmp_path, make_shards, monkeypatch, where, call, pause_s, clean):
    left = []
    monkeypatch.setattr(train_gpt, "leave_process_group", lambda clean: left.append(clean))
    signalled_in_process(tmp_path, make_shards, monkeypatch, where, call, pause_s)
    assert left == [clean]


def test_a_crash_leaves_the_group_as_an_unclean_one(tmp_path, make_shards, monkeypatch):
    train_glob, val_glob, _ = make_shards()
    left = []
    monkeypatch.setattr(train_gpt, "leave_process_group", lambda clean: left.append(clean))
    monkeypatch.setattr(train_gpt, "lr_factor_at", lambda step, args: 1 / 0 if step == 2 else 1.0)
    argv = tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=tmp_path, num_iterations=5, val_every=0)
    assert train_gpt.main(argv, {}) == train_gpt.EXIT_ERROR
    assert left == [False]


def test_a_signal_while_a_checkpoint_is_read_is_no_damaged_checkpoint(tmp_path, monkeypatch):
    """--resume reads the checkpoint again in set-up, where Ctrl-C raises inside torch.load."""
    torch.save({"format": ckpt.CHECKPOINT_FORMAT}, tmp_path / "run.pt")  # a sound zip: torch.load is reached

    def interrupted_load(*args, **kwargs):
        raise launcher.Interrupted()
    monkeypatch.setattr(torch, "load", interrupted_load)
    with pytest.raises(launcher.Interrupted):
        ckpt.read_checkpoint(str(tmp_path / "run.pt"), "resume")


# ------------------------------------------------------------------------------ log directory and disk

def test_log_dir_that_root_cannot_write_is_a_config_error(tmp_path, capsys):
    """Permission bits do not stop root: the check writes a real file, which /proc refuses to anyone."""
    if not os.path.isdir("/proc/self"):
        pytest.skip("needs Linux /proc")
    assert train_gpt.main(["--log_dir=/proc/forbidden"], {}) == train_gpt.EXIT_CONFIG
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert err[0].startswith("train_gpt.py: error: --log_dir='/proc/forbidden': cannot create the folder")


def test_log_dir_on_a_full_disk_is_a_config_error(tmp_path, monkeypatch):
    """A full disk with inodes left creates the probe file but cannot write to it: the check
    writes, so the run is refused before it starts, not at its log's first line."""
    real = tempfile.NamedTemporaryFile

    class FullDisk:
        def __init__(self, **kwargs):
            self.file = real(**kwargs)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(cfg.tempfile, "NamedTemporaryFile", FullDisk)
    with pytest.raises(train_gpt.ConfigError, match=r"cannot write a file in .* \(No space left on device\)$"):
        cfg.check_log_dir(train_gpt.Hyperparameters(log_dir=str(tmp_path / "records")))
    assert list(tmp_path.iterdir()) == []


def test_log_dir_check_leaves_nothing_behind(tmp_path):
    cfg.check_log_dir(train_gpt.Hyperparameters(log_dir=str(tmp_path / "new" / "records")))
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "records").mkdir()
    cfg.check_log_dir(train_gpt.Hyperparameters(log_dir=str(tmp_path / "records")))
    assert list((tmp_path / "records").iterdir()) == []


def fail_log_writes(monkeypatch, when):
    """Writes of the run log raise ENOSPC from the first line for which when(text) holds."""
    original = train_gpt.RunLog._append
    failing = []

    def append(self, text):
        if failing or when(text):
            failing.append(text)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        original(self, text)
    monkeypatch.setattr(train_gpt.RunLog, "_append", append)


@pytest.mark.parametrize("when, step", [(lambda text: "\nworld_size=" in text, 0),  # the header's second write
                                        (lambda text: text.startswith("step:3/6 train"), 3),
                                        (lambda text: text.startswith("peak memory"), 6)])
def test_full_disk_ends_the_run_with_one_line_naming_the_log_and_the_step(tmp_path, make_shards, monkeypatch,
                                                                          capsys, when, step):
    train_glob, val_glob, _ = make_shards()
    log_dir = tmp_path / "records"
    fail_log_writes(monkeypatch, when)
    argv = tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=log_dir, num_iterations=6, val_every=0,
                     check_every=1, warmup_steps=1)
    assert train_gpt.main(argv, {}) == train_gpt.EXIT_ERROR
    path = next(log_dir.glob("*/*.txt"))
    console = capsys.readouterr()
    err = console.err.strip().splitlines()
    assert err == [f"train_gpt.py: error: cannot write the log {path} (No space left on device) at step {step}/6; "
                   "the lines written before are kept"]
    text = path.read_text()
    assert text.endswith("\n")  # whole lines only, up to the one that failed
    last = {0: "CPU: ", 3: "step:2/6 train_time", 6: "step:6/6 val_loss"}[step]
    assert text.splitlines()[-1].startswith(last)
    if step == 0:  # stopped before compiling and warming up
        assert "arming up kernels" not in console.out


def test_a_signal_as_the_handlers_go_in_is_reported_and_they_are_put_back(tmp_path, make_shards, monkeypatch, capfd):
    """A Ctrl-C that lands the moment main() has installed its handlers (before the with statement
    returns) is an interruption at step 0 like any in set-up: one line, status 130, and the caller's
    handlers back in place (it escaped main() as a traceback, and left main()'s handler installed)."""
    train_glob, val_glob, _ = make_shards()
    before = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    install = signal.signal

    def ctrl_c_just_after(signum, handler):
        previous = install(signum, handler)
        if signum == signal.SIGTERM and isinstance(handler, launcher.StopSignals):
            os.kill(os.getpid(), signal.SIGINT)  # delivered at the next bytecode, in the handler just installed
        return previous
    monkeypatch.setattr(train_gpt.signal, "signal", ctrl_c_just_after)
    try:
        status = train_gpt.main(tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=tmp_path), {})
    finally:
        after = {signum: signal.getsignal(signum) for signum in before}
        for signum, handler in before.items():
            install(signum, handler)
    assert status == 130 and after == before
    assert capfd.readouterr().out.splitlines()[-2] == f"interrupted at step 0/{TINY['num_iterations']} (SIGINT)"
