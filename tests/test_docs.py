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
