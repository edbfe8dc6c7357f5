"""The documentation's pages: every relative link in README.md and docs/*.md reaches a file of the
checkout, every #fragment a heading of its page (GitHub's anchors), and every page under docs/ is
listed by the README. (The shell and Python blocks the pages promise run in the tests of their
topic: test_readme.py, test_verbs.py, test_grpo.py; the feature table is test_features.py's.)"""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The page without its fenced blocks (a # there is a shell comment, a [..](..) code)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def anchors(text: str) -> set[str]:
    """GitHub's anchor of each heading: lower case, punctuation but - and _ dropped, spaces as -."""
    out = set()
    for heading in re.findall(r"^#{1,6} (.+)$", prose(text), flags=re.M):
        out.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return out


def broken_links(page: pathlib.Path) -> list[str]:
    problems = []
    for target in LINK.findall(prose(page.read_text())):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"{page.name}: {target}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest.read_text()):
            problems.append(f"{page.name}: {target}: no such heading in {dest.name}")
    return problems


@pytest.mark.framework_free
def test_every_link_reaches_its_file_and_heading():
    problems = [p for page in PAGES for p in broken_links(page)]
    assert problems == [], "\n".join(problems)


@pytest.mark.framework_free
def test_the_checker_sees_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n[ok](b.md#the-part) [gone](c.md) [nowhere](b.md#other)\n"
                                   "```bash\n# not a heading, [not](a-link.md)\n```\n")
    (tmp_path / "b.md").write_text("# B\n\n## The part (`x.py`, 2 cores)\n\n## The part\n")
    assert anchors((tmp_path / "b.md").read_text()) == {"b", "the-part-xpy-2-cores", "the-part"}
    assert broken_links(tmp_path / "a.md") == ["a.md: c.md: no such file", "a.md: b.md#other: no such heading in b.md"]


@pytest.mark.framework_free
def test_the_readme_lists_every_page():
    listed = {(ROOT / target.partition("#")[0]).resolve() for target in LINK.findall((ROOT / "README.md").read_text())}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in listed]
    assert missing == [], missing
