"""The README stays what a newcomer reads first, and no link in the docs leads nowhere.

The README is capped in characters: the reference lives under docs/, one page per topic, and
the README links to it. Every relative link in README.md, deploy/README.md and docs/*.md must
name a path in the repository and, with a ``#fragment``, a heading of that page as GitHub
spells its anchors.
External links are not fetched (the suite runs without a network).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_LIMIT = 15_000
PAGES = [ROOT / "README.md", ROOT / "deploy" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^ {0,3}(```|~~~)")
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)   # http:, https:, mailto:, ...


def prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks, where links and headings are rendered."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def links(text: str) -> list[str]:
    """Every link target in a page: inline links, images and reference definitions."""
    found = []
    for line in prose_lines(text):
        if m := REFERENCE.match(line):
            found.append(m.group(1))
            continue
        # A link inside a code span is not one; a code span inside a link's text is kept.
        bare = CODE_SPAN.sub(lambda m: "x" * len(m.group(0)) if "](" in m.group(2) else m.group(0), line)
        found += [m.group(1) for m in INLINE_LINK.finditer(bare)]
    return found


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: the rendered text, lower case, punctuation dropped,
    spaces as hyphens (github-slugger)."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)   # a link renders as its text
    text = text.replace("`", "").replace("*", "")
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every heading anchor of a page; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(text):
        if m := HEADING.match(line):
            base = slug(m.group(2))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken(page: Path, root: Path = ROOT) -> list[str]:
    """The links of ``page`` that lead to no path under ``root`` or to no heading."""
    bad = []
    for target in links(page.read_text()):
        if not target or EXTERNAL.match(target):
            continue
        path, _, fragment = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.is_relative_to(root) or not dest.exists():
            bad.append(f"{target}: no such path")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest.read_text()):
            bad.append(f"{target}: no heading #{fragment} in {dest.relative_to(root)}")
    return bad


def test_readme_is_short_enough_to_read_first():
    size = len((ROOT / "README.md").read_text())
    assert size <= README_LIMIT, f"README.md has {size:,} characters, over {README_LIMIT:,}: move reference to docs/"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken(page) == []


def test_the_readme_links_to_the_reference_pages():
    # The settings table lives in docs/settings.md alone (made from the code); the README links there.
    targets = {t.partition("#")[0] for t in links((ROOT / "README.md").read_text())}
    assert "docs/settings.md" in targets and "docs/http-api.md" in targets


def test_anchors_are_spelled_as_github_spells_them():
    assert slug("Tensor batches and the data stall (`python -m shardfeed.benchmarks.stall`)") == \
        "tensor-batches-and-the-data-stall-python--m-shardfeedbenchmarksstall"
    assert slug("Scale: 10^8 samples, 10^7 cached blocks") == "scale-108-samples-107-cached-blocks"
    assert slug("The status page's cost") == "the-status-pages-cost"
    assert slug("What `shardfeed index` reads") == "what-shardfeed-index-reads"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n## A\n") == {"a", "a-1", "a-2"}


def test_links_are_found_where_they_render_and_nowhere_else(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("See [there](other.md#part) and ![plot](plot.png).\n"
                    "`[not](a-link.md)` and\n```\n[nor](this.md)\n```\n[ref]: ref.md\n"
                    "[`code` in text](code.md) [web](https://example.org/x)\n")
    assert links(page.read_text()) == ["other.md#part", "plot.png", "ref.md", "code.md", "https://example.org/x"]
    (tmp_path / "other.md").write_text("# Part\n")
    (tmp_path / "code.md").write_text("")
    (tmp_path / "ref.md").write_text("")
    assert broken(page, tmp_path) == ["plot.png: no such path"]
    (tmp_path / "other.md").write_text("# Whole\n")
    (tmp_path / "plot.png").write_bytes(b"")
    assert broken(page, tmp_path) == ["other.md#part: no heading #part in other.md"]
