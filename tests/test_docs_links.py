"""Every relative link in README.md and docs/**/*.md resolves: the file exists and, for
`file.md#anchor`, the anchor is a heading of that file (GitHub's slugs). Fast: no network."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

FENCE = re.compile(r"^(```|~~~)")
INLINE_CODE = re.compile(r"`[^`]*`")
# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def _prose_with_code(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks; headings keep their inline code (it is
    part of an anchor's text)."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append((n, line))
    return out


def _prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, inline code removed."""
    return [(n, INLINE_CODE.sub("", line)) for n, line in _prose_with_code(text)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, markup and punctuation dropped, spaces to '-'."""
    s = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    s = s.replace("`", "").replace("*", "").strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


@cache
def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for _, line in _prose_with_code(path.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        k = seen.get(base, 0)
        seen[base] = k + 1
        out.add(base if k == 0 else f"{base}-{k}")
    out.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", path.read_text(encoding="utf-8")))
    return out


def links(page: Path) -> list[tuple[int, str]]:
    return [(n, m.group(1)) for n, line in _prose(page.read_text(encoding="utf-8"))
            for m in LINK.finditer(line)]


def broken(page: Path, root: Path = ROOT) -> list[str]:
    bad = []
    for n, target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto:, ...
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / unquote(path)).resolve() if path else page
        where = f"{page.relative_to(root)}:{n}: {target}"
        if not dest.exists():
            bad.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and unquote(anchor) not in anchors(dest):
            bad.append(f"{where} (no heading #{anchor} in {dest.name})")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert broken(page) == []


def test_the_checker_catches_a_broken_link(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# Top\n\n## Some `code` here\n\nsee [b](b.md), [x](a.md#nope),"
                                   " [ok](a.md#some-code-here), [top](#top)\n")
    assert [b.split(" (")[0] for b in broken(tmp_path / "a.md", tmp_path)] == [
        "a.md:5: b.md", "a.md:5: a.md#nope"]


def test_every_docs_page_is_in_the_index() -> None:
    index = ROOT / "docs" / "index.md"
    listed = {(index.parent / t.partition("#")[0]).resolve() for _, t in links(index)}
    missing = [str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.md")
               if p != index and p.resolve() not in listed]
    assert missing == []
