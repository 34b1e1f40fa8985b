"""README's "Trying an idea" recipes: each diff applies to train_gpt.py as it is, touches one
top-level definition, and the fork it makes (a copy of the file alone) trains."""

import ast
import re
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, tiny_argv

pytestmark = pytest.mark.slow


def recipes():
    """(title, [hunk, ...]) per diff block of the section; a hunk is its (old, new) text."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Trying an idea", 1)[1].split("\n## ", 1)[0]
    found = []
    for title, block in re.findall(r"\*\*(.+?)\*\*(?:(?!\*\*).)*?```diff\n(.*?)```", section, re.S):
        hunks = []
        for hunk in block.split("@@\n"):
            lines = hunk.rstrip("\n").split("\n")
            old = "\n".join(line[1:] for line in lines if line[:1] in (" ", "-"))
            new = "\n".join(line[1:] for line in lines if line[:1] in (" ", "+"))
            hunks.append((old, new))
        found.append((title, hunks))
    return found


def test_readme_shows_the_three_recipes():
    assert [title for title, _ in recipes()] == ["Change the MLP activation", "Add an Adam-trained scalar",
                                                 "Add an lr warmup"]


def train_a_copy(source, tmp_path, make_shards, name):
    """A copy of the file alone trains 3 steps on the seeded shards: its log and the val losses."""
    copy = tmp_path / name / "train_gpt.py"
    copy.parent.mkdir()
    copy.write_text(source)
    train_glob, val_glob, _ = make_shards()
    done = subprocess.run([sys.executable, str(copy), *tiny_argv(train_files=train_glob, val_files=val_glob,
                                                                 log_dir=tmp_path / f"{name}_logs", num_iterations=3)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    log = next((tmp_path / f"{name}_logs").glob("*/*.txt")).read_text()
    return log, [float(v) for v in re.findall(r"^step:\d/3 val_loss:(\d+\.\d+) ", log, re.M)]


_UNEDITED = []  # the unedited copy's val losses on the same shards, once per worker


@pytest.mark.parametrize("title, hunks", recipes(), ids=lambda v: v if isinstance(v, str) else "")
def test_a_readme_recipe_applies_to_one_place_and_its_fork_trains(tmp_path, make_shards, title, hunks):
    """...and trains another model than the unedited file's (the edit runs), its loss falling."""
    source = (ROOT / "train_gpt.py").read_text()
    tree = ast.parse(source)
    places = set()
    edited = source
    for old, new in hunks:
        assert source.count(old) == 1, f"{title}: the diff's lines are not in train_gpt.py once:\n{old}"
        line = source[:source.index(old)].count("\n") + 1
        places |= {node.name for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))
                   and node.lineno <= line <= node.end_lineno}
        edited = edited.replace(old, new)
    assert len(places) == 1, f"{title}: touches {places or 'no definition'}"
    if not _UNEDITED:
        _UNEDITED.extend(train_a_copy(source, tmp_path, make_shards, "unedited")[1])
    log, losses = train_a_copy(edited, tmp_path, make_shards, "fork")
    assert all(new in log for _, new in hunks)  # the log holds the code that ran
    assert len(losses) == len(_UNEDITED) == 3 and losses[-1] < losses[0]  # steps 0, 2 and 3
    assert losses[0] == _UNEDITED[0] or "activation" in title  # (the activation changes step 0's too)
    assert losses[-1] != _UNEDITED[-1]
    if "scalar" in title:
        assert "blocks.0.mlp_gain: () adam scalar lr_mult=5.0" in log
