"""Relative links in README.md, docs/, BENCHMARKS.md and benchmarks/'s READMEs point at files
that exist and, with a #fragment into a Markdown page, at one of its headings."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

import pytest

from tests.docs.pages import ROOT, pages

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|__|\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(page: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    found, fenced = set(), False
    for line in page.read_text().splitlines():
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        m = None if fenced else HEADING.match(line)
        if m:
            base = slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return frozenset(found)


def links(page: Path) -> list[tuple[int, str]]:
    found, fenced = [], False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
            continue
        if not fenced:
            found += [(number, m.group(1) or m.group(2)) for m in LINK.finditer(line)]
    return found


def broken(page: Path, root: Path = ROOT) -> list[str]:
    problems = []
    for number, target in links(page):
        if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
            continue
        path_part, _, fragment = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(root)}:{number}: {target}"
        if not dest.exists():
            problems.append(f"{where}: no such file")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            problems.append(f"{where}: no heading with that anchor in {dest.name}")
    return problems


PAGES = [*pages(), ROOT / "BENCHMARKS.md", *sorted((ROOT / "benchmarks").rglob("README.md"))]


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page: Path) -> None:
    assert not broken(page), "\n".join(broken(page))


def test_the_checker_finds_a_broken_link_and_a_missing_anchor(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Top `title`\n## Two words, here\n[a](#top-title) [b](#two-words-here) [c](#nope)\n"
        "[d](missing.md) [e](page.md#two-words-here)\n```\n[f](ignored.md)\n```\n"
    )
    problems = [p.split(": ", 1)[1] for p in broken(page, tmp_path)]
    assert problems == ["#nope: no heading with that anchor in page.md", "missing.md: no such file"]
