"""The README's promise for a machine without GPUs: `./run.sh` trains the cpu preset on the
embedded sample, validation loss falls by at least 2 nats, and the run's log is written."""

import math
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from conftest import ROOT


def test_run_sh_trains_the_cpu_preset(tmp_path):
    checkout = tmp_path / "clone"  # a copy, as from a fresh clone: no FineWeb, no records
    shutil.copytree(ROOT, checkout, ignore=shutil.ignore_patterns(".git", "records", "__pycache__", "fineweb10B"))
    env = dict(os.environ, PYTHON=sys.executable)
    started = time.time()
    proc = subprocess.run(["./run.sh"], cwd=checkout, env=env, capture_output=True, text=True, timeout=900)
    elapsed = time.time() - started
    assert proc.returncode == 0, proc.stderr[-3000:]
    logs = list((checkout / "records").glob("*_dev/*.txt"))
    assert len(logs) == 1
    text = logs[0].read_text()
    assert "training on the embedded sample" in text
    losses = [float(x) for x in re.findall(r"^step:\d+/\d+ val_loss:(\d+\.\d+)", text, re.M)]
    assert losses[0] == pytest.approx(math.log(50304), abs=1e-3)
    assert losses[-1] <= losses[0] - 2.0, losses
    assert re.search(r"^peak memory allocated: \d+ MiB reserved: \d+ MiB$", text, re.M)
    print(f"run.sh took {elapsed:.0f} s; val losses {losses}")
    assert elapsed < 300, f"the cpu preset should finish in under 5 minutes on 2 cores, took {elapsed:.0f} s"


def test_run_sh_reads_paths_relative_to_where_it_is_started(tmp_path):
    """From another folder, a relative path names a file there (run.sh once cd-ed into the repository)."""
    (tmp_path / "mine.pt").write_bytes(b"junk")
    env = dict(os.environ, PYTHON=sys.executable, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([str(ROOT / "run.sh"), "--resume", "mine.pt", "--log_dir", "logs"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr == ("train_gpt.py: error: --resume='mine.pt': not a checkpoint written by train_gpt.py "
                           "(not a torch.save file)\n")
