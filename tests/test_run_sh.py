"""The README's promise for a machine without GPUs: `./run.sh` trains the cpu preset on the
embedded sample, validation loss falls by at least 2 nats, and the run's log is written."""

import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow  # launches fresh processes: the full suite only (README, Test)


def test_run_sh_trains_the_cpu_preset(tmp_path):
    """README's main job on a copy as from a fresh clone, a twelfth of its 120 steps (its arguments
    pass through). Its time is README's figure, measured with README's command, not asserted here:
    a timing bound fails on a busy machine and says nothing about correctness."""
    checkout = tmp_path / "clone"  # a copy, as from a fresh clone: no FineWeb, no records
    shutil.copytree(ROOT, checkout, ignore=shutil.ignore_patterns(".git", "records", "__pycache__", "fineweb10B"))
    env = dict(os.environ, PYTHON=sys.executable)
    started = time.time()
    proc = subprocess.run(["./run.sh", "--num_iterations", "10", "--val_every", "10"], cwd=checkout, env=env,
                          capture_output=True, text=True, timeout=900)
    elapsed = time.time() - started
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = list((checkout / "records").glob("*_dev/*.txt"))
    assert len(logs) == 1
    text = logs[0].read_text()
    assert "training on the embedded sample" in text
    losses = [float(x) for x in re.findall(r"^step:\d+/\d+ val_loss:(\d+\.\d+)", text, re.M)]
    # near ln(50304), not at it: the head starts at N(0, 0.005), not at zero (init 2026; 10.7953)
    assert losses[0] == pytest.approx(math.log(50304), abs=0.05)
    assert losses[-1] <= losses[0] - 2.0, losses  # 10.80 -> 7.94
    assert re.search(r"^peak memory allocated: \d+ MiB reserved: \d+ MiB$", text, re.M)
    print(f"run.sh took {elapsed:.0f} s; val losses {losses}")


def test_run_sh_reads_paths_relative_to_where_it_is_started(tmp_path):
    """From another folder, a relative path names a file there (run.sh once cd-ed into the repository)."""
    (tmp_path / "mine.pt").write_bytes(b"junk")
    env = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([str(ROOT / "run.sh"), "--resume", "mine.pt", "--log_dir", "logs"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr == ("train_gpt.py: error: --resume='mine.pt': not a checkpoint written by train_gpt.py "
                           "(not a torch.save file)\n")


def test_run_sh_help_is_printed_once_with_its_own_variables(tmp_path):
    """NPROC=2 ./run.sh --help printed the trainer's help once per process (150 lines twice) and
    nothing about run.sh's variables: now run.sh's header, then the trainer's fields, once, with
    the values the launch would give (run.sh sets MICRO_BATCHES to the processes on CPU)."""
    env = dict(os.environ, PYTHON=sys.executable, NPROC="2", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([str(ROOT / "run.sh"), "--num_iterations", "5", "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    assert proc.stdout.startswith("Train with every GPU this machine has")
    assert proc.stdout.count("usage: train_gpt.py") == 1 and "--num_iterations=5" in proc.stdout
    assert "--micro_batches=2 " in proc.stdout
    # every variable run.sh reads is explained there, but torch's own, which it honours as torch does
    read = set(re.findall(r'\$\{?([A-Z][A-Z_0-9]*)|environ(?:\.get\(|\[)"([A-Z_]+)"', (ROOT / "run.sh").read_text()))
    read = {name for pair in read for name in pair if name} - {"OMP_NUM_THREADS", "TORCH_CPP_LOG_LEVEL"}
    assert {"NPROC", "MICRO_BATCHES", "MASTER_PORT", "LOGLEVEL"} <= read  # the pattern still finds them
    header = proc.stdout.split("usage:")[0]
    assert [name for name in sorted(read) if name not in header] == []
    assert list(tmp_path.iterdir()) == []


def test_a_resume_over_several_cpu_processes_keeps_the_checkpoints_micro_batches(tmp_path):
    """On CPU run.sh sets MICRO_BATCHES to the processes, which outranked the checkpoint: a run
    trained with 4 micro-batches was refused by NPROC=2 ./run.sh --resume (4 there, 2 here), though
    2 processes split 4. With --resume (or RESUME) the checkpoint's stays, unless MICRO_BATCHES is set."""
    torch = pytest.importorskip("torch")
    import train_gpt
    from harness import checkpoints as ckpt
    torch.save(dict(format=ckpt.CHECKPOINT_FORMAT, config=dict(preset="cpu", micro_batches=4), step=1),
               tmp_path / "run.pt")
    env = dict(os.environ, PYTHON=sys.executable, NPROC="2", CUDA_VISIBLE_DEVICES="")
    for args, extra, expected in [(["--resume", "run.pt"], {}, "--micro_batches=4 "),
                                  (["--resume=run.pt"], {}, "--micro_batches=4 "),
                                  ([], {"RESUME": "run.pt"}, "--micro_batches=4 "),
                                  (["--resume", "run.pt"], {"MICRO_BATCHES": "2"}, "--micro_batches=2 "),
                                  ([], {}, "--micro_batches=2 "),
                                  (["--micro-batches", "4"], {}, "--micro_batches=4 ")]:  # the user's, spelt either way
        proc = subprocess.run([str(ROOT / "run.sh"), *args, "--help"], cwd=tmp_path, env=dict(env, **extra),
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and expected in proc.stdout, (args, extra, proc.stderr[-2000:])


@pytest.mark.parametrize("device, environment, on_cpu", [
    (["--device", "cpu"], {}, True), (["--device=cpu"], {}, True), ([], {"DEVICE": "cpu"}, True),
    (["--device", "cuda", "--device", "cpu"], {}, True), ([], {}, False), (["--device", "cuda"], {}, False),
    (["--device", "cpu", "--device=auto"], {}, False), (["--device", "cuda"], {"DEVICE": "cpu"}, False)])
def test_run_sh_with_device_cpu_on_a_gpu_machine_runs_as_without_gpus(tmp_path, device, environment, on_cpu):
    """On a machine with 8 GPUs (an interpreter that says so and records how it was called), the
    device the trainer will take (the last --device, else DEVICE) being cpu, run.sh runs it as one
    process, as without GPUs (8 processes could not split the cpu preset's one micro-batch);
    otherwise torchrun starts one process per GPU."""
    calls = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(textwrap.dedent(f"""\
        #!/usr/bin/env bash
        case "$2" in *device_count*) echo 8; exit 0;; esac
        if [ "$1" = -c ]; then shift 2; printf 'torchrun %s\\n' "$*"; else printf '%s\\n' "$*"; fi >> {calls}
        """))
    fake.chmod(0o755)
    env = dict(os.environ, PYTHON=str(fake), **environment)
    env.pop("NPROC", None)
    if "DEVICE" not in environment:
        env.pop("DEVICE", None)
    proc = subprocess.run(["./run.sh", "--preset", "cpu", *device, "--num_iterations", "5"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    [call] = calls.read_text().splitlines()
    trainer = str(ROOT / "train_gpt.py")
    passed = " ".join([trainer, "--preset", "cpu", *device, "--num_iterations", "5"])
    if on_cpu:
        assert call == passed
    else:
        assert call.startswith("torchrun ") and "--nproc_per_node=8" in call and call.endswith(passed)
