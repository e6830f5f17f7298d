"""Links in README.md, CHANGES.md, docs/ and benchmarks/RESULTS.md lead to files and headings that exist.

Anchors follow GitHub's rule: a heading's text lower-cased, every character but letters, digits,
spaces, hyphens and underscores dropped, spaces made hyphens, ``-1``, ``-2``... for repeats.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

import support

ROOT = support.ROOT
PAGES = [ROOT / "README.md", ROOT / "CHANGES.md", ROOT / "benchmarks" / "RESULTS.md",
         *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    in_code = False
    for line in page.read_text().splitlines():
        in_code = in_code != line.startswith("```")
        match = re.match(r"^#{1,6} (.+)$", line)
        if match and not in_code:
            slug = re.sub(r"[^\w\- ]", "", match[1].strip().lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def test_the_front_door_is_short_and_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    for page in PAGES[1:]:
        assert str(page.relative_to(ROOT)) in readme, page


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_leads_to_a_file_and_heading_that_exist(page):
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"^[a-z]+:", target):
            continue  # a web address
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(target)
    assert broken == []
