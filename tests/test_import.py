"""`import train_gpt` must have no side effects: no process group, no files, no CUDA context."""

import subprocess
import sys

from conftest import ROOT

PROBE = """
import sys
sys.path.insert(0, {root!r})
import torch, torch.distributed as dist
import train_gpt
assert not dist.is_initialized(), "process group created at import"
assert not torch.cuda.is_initialized(), "CUDA initialized at import"
print("ok")
"""


def test_import_has_no_side_effects(tmp_path):
    proc = subprocess.run([sys.executable, "-c", PROBE.format(root=str(ROOT))], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
    assert list(tmp_path.iterdir()) == [], "import wrote files into the working directory"


def test_main_only_runs_as_a_script():
    source = (ROOT / "train_gpt.py").read_text()
    assert 'if __name__ == "__main__":\n    sys.exit(main())' in source
