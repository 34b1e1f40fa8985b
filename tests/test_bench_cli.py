"""bench/ns_loss.py, bench/sample_speed.py and bench/ns_compile.py: a bad option or file is one
line naming it (exit 2), and Ctrl-C ends ns_loss.py in one line (exit 130), not a traceback."""

import signal
import subprocess
import sys

import pytest

from conftest import ROOT, sigint_as_at_a_terminal

pytestmark = pytest.mark.slow  # launches fresh processes: the full suite only (README, Test)


def bench(script, *args):
    return subprocess.run([sys.executable, str(ROOT / "bench" / script), *args], capture_output=True, text=True,
                          timeout=120, cwd=ROOT)


def test_sample_speed_names_a_missing_checkpoint_in_one_line(tmp_path):
    """The checkpoint is a positional argument: the message names it as such, not as an --option."""
    done = bench("sample_speed.py", str(tmp_path / "nonexist.pt"))
    assert done.returncode == 2
    assert done.stderr == f"sample_speed.py: error: checkpoint '{tmp_path / 'nonexist.pt'}': no such file\n"
    (tmp_path / "notes.pt").write_text("not a checkpoint")
    done = bench("sample_speed.py", str(tmp_path / "notes.pt"))
    assert (done.returncode, done.stderr) == (2, f"sample_speed.py: error: checkpoint '{tmp_path / 'notes.pt'}': "
                                                 "not a checkpoint written by train_gpt.py (not a torch.save file)\n")


def test_ns_loss_names_a_bad_trainer_option_in_one_line_before_any_run():
    done = bench("ns_loss.py", "--steps", "10", "--", "--bogus")
    assert (done.returncode, done.stderr, done.stdout) == (2, "ns_loss.py: error: unknown option --bogus\n", "")
    done = bench("ns_loss.py", "--methods", "aol", "polar_express", "--", "--muon_lr", "fast")
    assert (done.returncode, done.stderr) == (2, "ns_loss.py: error: --muon_lr='fast': expected float\n")


def test_ctrl_c_ends_ns_loss_in_one_line():
    """Interrupted inside its first training run (the script run as __main__, with train() saying
    when it starts)."""
    code = ("import runpy, sys\n"
            f"sys.path.insert(0, {str(ROOT)!r})\n"
            "import train_gpt\n"
            "train = train_gpt.train\n"
            "def announced(*args, **kwargs):\n"
            "    print('training', flush=True)\n"
            "    return train(*args, **kwargs)\n"
            "train_gpt.train = announced\n"
            "sys.argv = ['ns_loss.py', '--steps', '50']\n"
            f"runpy.run_path({str(ROOT / 'bench' / 'ns_loss.py')!r}, run_name='__main__')\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            cwd=ROOT, preexec_fn=sigint_as_at_a_terminal)
    try:
        assert proc.stdout.readline() == "training\n", proc.stderr.read()
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "Traceback" not in stderr, stderr
    assert stderr.strip().splitlines()[-1] == "ns_loss.py: interrupted"


def test_ns_compile_names_a_bad_option_and_needs_a_gpu():
    done = bench("ns_compile.py", "--world-sizes", "1,2")
    assert (done.returncode, done.stderr) == (2, "ns_compile.py: error: --world-sizes='1,2': expected 1, 8 or 1,8\n")
    done = bench("ns_compile.py", "--methods", "aol,svd")
    assert (done.returncode, done.stderr) == (
        2, "ns_compile.py: error: --methods='aol,svd': 'svd' is none of newton_schulz, polar_express, aol\n")
    import torch
    if not torch.cuda.is_available():
        done = bench("ns_compile.py")
        assert (done.returncode, done.stdout) == (2, "")
        assert done.stderr.startswith("ns_compile.py: error: needs a CUDA GPU")
