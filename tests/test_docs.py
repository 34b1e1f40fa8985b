"""README and the documents beside it: README stays short, and every relative link (file and
#anchor) points at something that exists."""

import re

import pytest

from conftest import ROOT

DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "records" / "README.md",
             ROOT / "bench" / "README.md", ROOT / "data" / "README.md"]


def anchors(path):
    """GitHub's anchors for a Markdown file's headings."""
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    slugs = set()
    for heading in re.findall(r"^#+ (.+)$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")
        slugs.add(slug)
    return slugs


def test_readme_is_short():
    words = len((ROOT / "README.md").read_text().split())
    assert words <= 2500, f"README.md has {words} words; details belong in docs/"


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_point_at_files_and_headings_that_exist(path):
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            broken.append(target)
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
            broken.append(target)
    assert broken == []


def test_ci_runs_the_readme_test_command_exactly():
    """.ci/run installs, then runs the README's full-suite command as README prints it: no variable
    exported or flag added that a user copying the README would lack."""
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"## Test\n+```bash\n(.*?)```", readme, re.S)[1]
    suite = [line.partition("#")[0].strip() for line in block.splitlines() if "pytest" in line][0]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()
          if line.strip() and not line.lstrip().startswith("#")]
    assert ci[-1] == suite
    assert not [line for line in ci if line.startswith("export") or "=" in line.split()[0]]
