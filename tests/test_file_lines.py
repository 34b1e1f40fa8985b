"""train_gpt.py's size (bench/file_lines.py): during the port to the 2026-01-19 record the file
stays within 1.5x that record's two files (train_gpt.py 1,909 + triton_kernels.py 531 = 2,440
lines), and at least three quarters of it is the computation, the harness living in harness/."""

import subprocess
import sys
from pathlib import Path

from bench import file_lines

ROOT = Path(__file__).resolve().parents[1]
RECORD_2026_LINES = 1909 + 531


def test_train_gpt_stays_within_its_line_budget():
    total, harness, sections = file_lines.classify(str(ROOT / "train_gpt.py"))
    assert total <= 1.5 * RECORD_2026_LINES, total
    assert total - harness >= 0.75 * total, (total, harness)
    assert [title.split(".")[0] for title, _, _ in sections] == [str(i) for i in range(1, 10)]  # reading order


def test_the_count_piped_into_head_ends_quietly():
    done = subprocess.run(f"{sys.executable} bench/file_lines.py | head -1", shell=True, cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.stdout.startswith("train_gpt.py: ") and done.stderr == ""
