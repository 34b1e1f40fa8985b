"""Launching: torchrun's variables are checked for consistency, mistakes in starting several
processes end in one line, and run.sh starts several CPU processes on one machine or on several
"machines" (two torchrun agents on 127.0.0.1 meeting through the c10d rendezvous), which train
exactly what one machine with the same number of processes trains, with one log."""

import os
import re
import subprocess
import sys
import time

import pytest
import torch

import train_gpt
from harness import config as cfg
from conftest import ROOT, tiny_argv
from test_distributed import LOSS_RTOL, free_port
from test_train_e2e import STEP_VAL

pytestmark = pytest.mark.slow  # launches fresh processes: the full suite only (README, Test)

TORCHRUN_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                      "MASTER_PORT", "NNODES", "NODE_RANK", "NPROC", "MICRO_BATCHES", "DIST_TIMEOUT_S")
MEETING_POINT = dict(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")


def test_second_process_of_the_second_machine():
    environ = dict(RANK="3", LOCAL_RANK="1", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", **MEETING_POINT)
    assert train_gpt.Ranks.from_env(environ) == train_gpt.Ranks(rank=3, local_rank=1, world_size=4,
                                                                local_world_size=2)


@pytest.mark.parametrize("environ, needle", [
    (dict(RANK="2", WORLD_SIZE="2", **MEETING_POINT), "RANK=2 must be below WORLD_SIZE=2"),
    (dict(RANK="0", LOCAL_RANK="2", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", **MEETING_POINT),
     "LOCAL_RANK=2 must be below LOCAL_WORLD_SIZE=2"),
    (dict(RANK="0", WORLD_SIZE="6", LOCAL_WORLD_SIZE="4", **MEETING_POINT),
     "LOCAL_WORLD_SIZE=4 must divide WORLD_SIZE=6"),
    (dict(RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="4", **MEETING_POINT),
     "LOCAL_WORLD_SIZE=4 must divide WORLD_SIZE=2"),
    (dict(RANK="2", LOCAL_RANK="1", WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", **MEETING_POINT),
     "RANK=2 and LOCAL_RANK=1 disagree"),
    (dict(WORLD_SIZE="2"), "start several processes with torchrun or ./run.sh"),
    (dict(WORLD_SIZE="2", RANK="1", MASTER_ADDR="127.0.0.1"), "no MASTER_ADDR and MASTER_PORT"),
])
def test_inconsistent_torchrun_variables_are_one_line(capsys, tmp_path, environ, needle):
    log_dir = tmp_path / "logs"
    assert train_gpt.main([f"--log_dir={log_dir}"], environ) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train_gpt.py: error: ") and needle in err[0], err
    assert err[0].endswith("in the environment")
    assert not log_dir.exists() and not train_gpt.dist.is_initialized()


def test_world_size_without_torchrun_is_one_line(tmp_path):
    """`WORLD_SIZE=2 python train_gpt.py` used to end in a 23-line MASTER_ADDR traceback."""
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    proc = subprocess.run([sys.executable, str(ROOT / "train_gpt.py")], cwd=tmp_path, env=dict(env, WORLD_SIZE="2"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("train_gpt.py: error: WORLD_SIZE=2 but no MASTER_ADDR and MASTER_PORT to meet at: "
                                   "start several processes with torchrun or ./run.sh (NPROC=N), not by setting "
                                   "WORLD_SIZE in the environment")
    assert list(tmp_path.iterdir()) == []


def test_micro_batches_hint_names_the_flag():
    with pytest.raises(train_gpt.ConfigError) as cpu:
        cfg.parse_config(["--preset=cpu"], {}, 2, False)
    assert str(cpu.value) == ("--micro_batches=1: world size 2 must divide it "
                              "(set --micro_batches=2 or another multiple of 2)")
    with pytest.raises(train_gpt.ConfigError) as cpu:
        cfg.parse_config(["--preset=cpu", "--micro_batches=6"], {}, 4, False)
    assert "set --micro_batches=8 or another multiple of 4" in str(cpu.value)
    # on GPUs the speedrun's batch is the point: fewer processes first, then the flag
    with pytest.raises(train_gpt.ConfigError) as gpu:
        cfg.parse_config([], {}, 16, True)
    assert str(gpu.value) == ("--micro_batches=8: world size 16 must divide it (launch a number of processes that "
                              "divides it, e.g. 1, 2, 4 or 8 for the speedrun's 8, or set --micro_batches=16 or "
                              "another multiple of 16)")

def checked_detect(args, ranks=None):
    """Hardware.detect as harness/launch.py calls it: after the harness's checks of this machine."""
    ranks = ranks or train_gpt.Ranks()
    cfg.check_machine(args, ranks)
    return train_gpt.Hardware.detect(args, ranks)



def test_more_processes_than_gpus_is_one_line(monkeypatch):
    gpus = 2   # a machine with two GPUs (the suite itself runs on the CPU: conftest)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    args = cfg.parse_config(tiny_argv(micro_batches=gpus + 1, preset="speedrun", attn_block_size=128), {},
                                  gpus + 1, True)  # FlexAttention's CUDA kernels take blocks of 128
    ranks = train_gpt.Ranks(rank=gpus, local_rank=gpus, world_size=gpus + 1, local_world_size=gpus + 1)
    with pytest.raises(train_gpt.ConfigError, match=f"this machine has {gpus} GPUs"):
        checked_detect(args, ranks)
    last = train_gpt.Ranks(rank=gpus - 1, local_rank=gpus - 1, world_size=gpus, local_world_size=gpus)
    assert checked_detect(args, last).device == torch.device("cuda", gpus - 1)


def test_the_suite_runs_on_the_cpu_on_every_machine():
    """conftest hides the GPUs and chooses Triton's interpreter, for the tests and the processes
    they start, so that the suite gives the same results on a GPU machine as in CI."""
    assert not torch.cuda.is_available() and train_gpt.TRITON_INTERPRETING
    assert os.environ["CUDA_VISIBLE_DEVICES"] == os.environ["HIP_VISIBLE_DEVICES"] == ""
    probe = ("import os, torch; print(torch.cuda.device_count(), os.environ['TRITON_INTERPRET'], "
             "repr(os.environ['CUDA_VISIBLE_DEVICES']))")
    child = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert child.stdout.split() == ["0", "1", "''"]


# --- run.sh on CPU: several processes, several machines ----------------------------------------

def start_run_sh(argv, tmp_path, **variables):
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    env.update(PYTHON=sys.executable, OMP_NUM_THREADS="1", **variables)
    return subprocess.Popen([str(ROOT / "run.sh"), *argv], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=120):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return out


def val_losses(log_dir):
    logs = list(log_dir.glob("*/*.txt"))
    assert len(logs) == 1, logs  # written by rank 0 alone
    text = logs[0].read_text()
    for line in ("world_size=2", "micro_batches=2", "grad_accum_steps=1"):  # run.sh fitted micro_batches
        assert re.search(f"^{line}$", text, re.M), line
    return [float(m.group(3)) for m in map(STEP_VAL.match, text.splitlines()) if m]


def test_two_machines_train_what_one_machine_trains(tmp_path, make_shards):
    train_glob, val_glob, _ = make_shards()
    # no --micro_batches: run.sh gives each of the 2 processes one; one thread each on either
    # launch, so both compute the same sums in the same order
    argv = [a for a in tiny_argv(train_files=train_glob, val_files=val_glob, val_every=1, threads=1)
            if not a.startswith("--micro_batches")]
    one = start_run_sh(argv + [f"--log_dir={tmp_path / 'one'}"], tmp_path, NPROC="2")
    out = finish(one)
    assert "set by the environment" not in out  # run.sh's micro-batches are no variable of the user's
    port = str(free_port())
    nodes = [start_run_sh(argv + [f"--log_dir={tmp_path / 'two'}"], tmp_path, NNODES="2", NODE_RANK=str(node),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=port, DIST_TIMEOUT_S="60") for node in (1, 0)]
    outputs = [finish(node) for node in nodes]
    assert sum("step:4/4 val_loss:" in out for out in outputs) == 1  # one console shows training
    assert not any("MICRO_BATCHES" in out for out in outputs)  # DIST_TIMEOUT_S is the user's, and said so

    single, multi = val_losses(tmp_path / "one"), val_losses(tmp_path / "two")
    assert len(single) == len(multi) == 5  # val_every=1 over 4 steps, and step 0
    # it trains, not idles: 10.82 -> 10.71 in 4 steps (Adam, every 2nd step, moves the embeddings and
    # head twice; 10.61 with --adam_every 1)
    assert single[-1] < single[0] - 0.05
    assert multi == pytest.approx(single, rel=LOSS_RTOL)


def test_failed_process_ends_in_its_own_line_and_status(tmp_path):
    """torchrun alone adds a traceback, a failure summary and its log lines to the trainer's one line,
    printed by every rank."""
    proc = start_run_sh(tiny_argv(micro_batches=3, log_dir=tmp_path / "logs"), tmp_path, NPROC="2")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2
    # both ranks find the same fault; local rank 0 alone reports it, and torchrun's own lines are kept off
    assert err.startswith("train_gpt.py: error: --micro_batches=3: world size 2 must divide it (set --micro_batches=4")
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("node_rank", [0, 1])  # the rendezvous's host waits; another machine finds no host
def test_machine_that_never_joins_ends_in_one_line(tmp_path, make_shards, node_rank):
    train_glob, val_glob, _ = make_shards()
    argv = tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=tmp_path / "logs", micro_batches=2)
    port = free_port()
    started = time.time()
    node = start_run_sh(argv, tmp_path, NNODES="2", NODE_RANK=str(node_rank), MASTER_ADDR="127.0.0.1",
                        MASTER_PORT=str(port), DIST_TIMEOUT_S="3")
    out, err = node.communicate(timeout=120)
    assert node.returncode == 1
    assert err.strip().startswith(f"run.sh: not all NNODES=2 machines met at 127.0.0.1:{port} within "
                                  "DIST_TIMEOUT_S=3 s ("), err
    assert len(err.strip().splitlines()) == 1, err
    assert time.time() - started < 60
    assert not (tmp_path / "logs").exists()


def test_host_machine_that_stops_is_named_on_the_others(tmp_path, make_shards):
    """The machines meet, then the host's process stops at its options: the other machine's last
    line says so (run.sh's when its launcher finds the rendezvous gone, the trainer's when its
    process does), not that the machines never met or that a timeout ran out."""
    train_glob, val_glob, _ = make_shards()
    argv = tiny_argv(train_files=train_glob, val_files=val_glob, log_dir=tmp_path / "logs", micro_batches=2)
    port = str(free_port())
    machine = dict(NNODES="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, DIST_TIMEOUT_S="60")
    other = start_run_sh(argv, tmp_path, NODE_RANK="1", **machine)
    host = start_run_sh(argv + ["--seed=x"], tmp_path, NODE_RANK="0", **machine)
    started = time.time()
    _, host_err = host.communicate(timeout=120)
    _, other_err = other.communicate(timeout=120)
    assert host.returncode == 2 and host_err.strip() == "train_gpt.py: error: --seed='x': expected int"
    assert other.returncode == 1 and time.time() - started < 40
    last = other_err.strip().splitlines()[-1]
    assert (last.startswith(f"run.sh: the machines met, then the rendezvous at 127.0.0.1:{port} closed: its machine "
                            "(NODE_RANK=0) stopped, and its output says why (")
            or re.match(r"train_gpt.py: error: rank [01]: could not join 2 ranks: failed after \d+\.\d s, before "
                        r"--dist_timeout_s=60 ran out \(", last)), other_err[-2000:]
    assert "not all NNODES" not in other_err
