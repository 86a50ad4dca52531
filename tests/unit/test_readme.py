"""The README is a short page for users and docs/ holds the rest: the spec reference page is the one
generated from the models, every relative link (and its anchor) resolves, every docs page is in
the index, and the README links the index and every page it lists.

Each check is a function of the texts, tried here on the real files and on broken ones, so each
can be seen to fail.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

import pytest

from protrain.runtime.config.spec_doc import END, REFERENCE_PAGE, START, page_with_reference

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
INDEX = DOCS / "index.md"
README_MAX_LINES = 170

_FENCE = re.compile(r"^(```|~~~).*?^\1[ \t]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+).+?\1", re.DOTALL)
_INLINE_LINK = re.compile(r"\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t#]*$", re.MULTILINE)


def _prose(markdown: str) -> str:
    """The text outside fenced code blocks and code spans (links there are not links)."""
    return _CODE_SPAN.sub("", _FENCE.sub("", markdown))


def links(markdown: str) -> list[str]:
    """Every link target in ``markdown``, inline and reference style."""
    prose = _prose(markdown)
    return _INLINE_LINK.findall(prose) + _REFERENCE_LINK.findall(prose)


def relative_links(markdown: str) -> list[str]:
    """The targets that point into the repository (no scheme, not protocol-relative)."""
    return [t for t in links(markdown) if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//", t)]


def anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives the headings: lower case, punctuation dropped, spaces to
    hyphens, a repeated one numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for _, title in _HEADING.findall(_FENCE.sub("", markdown)):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link in a heading: its text
        slug = re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def broken_links(page: Path, root: Path) -> list[str]:
    """Each relative link of ``page`` whose file (inside ``root``) or heading anchor is missing."""
    broken = []
    for target in relative_links(page.read_text()):
        path_part, _, anchor = target.partition("#")
        file = (page.parent / path_part).resolve() if path_part else page
        if not file.is_relative_to(root.resolve()):
            broken.append(f"{target}: outside {root.name}")
        elif not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(f"{target}: no heading with that anchor in {file.name}")
    return broken


def linked_pages(page: Path) -> set[Path]:
    """The files ``page`` links to (anchors dropped)."""
    targets = (t.partition("#")[0] for t in relative_links(page.read_text()))
    return {(page.parent / t).resolve() for t in targets if t}


def pages_missing_from_index(index: Path, pages: Iterable[Path]) -> list[str]:
    listed = linked_pages(index)
    return sorted(p.name for p in pages if p.resolve() != index.resolve() and p.resolve() not in listed)


def _docs_pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))


# The real files.


def test_spec_reference_page_is_current() -> None:
    page = ROOT / REFERENCE_PAGE
    text = page.read_text()
    assert page_with_reference(text) == text, f"run `make spec-reference` and commit {REFERENCE_PAGE}"


def test_readme_gives_the_two_commands_and_stays_short() -> None:
    text = README.read_text()
    assert "make demo" in text and "make test" in text
    lines = len(text.splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; keep it a five-minute read, move detail to docs/"


def test_readme_links_the_index_and_every_page_it_lists() -> None:
    from_readme = linked_pages(README)
    assert INDEX.resolve() in from_readme, "README.md must link docs/index.md"
    missing = sorted(p.name for p in linked_pages(INDEX) if p.parent == DOCS.resolve() and p not in from_readme)
    assert not missing, f"README.md does not link these pages of docs/index.md: {missing}"


@pytest.mark.parametrize("page", [README, *_docs_pages()], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(page: Path) -> None:
    assert not broken_links(page, ROOT)


def test_every_docs_page_is_in_the_index() -> None:
    assert INDEX in _docs_pages()
    assert not pages_missing_from_index(INDEX, _docs_pages()), "list each docs page in docs/index.md"


# The checks fail on broken files.


def test_the_checks_catch_what_they_guard(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (docs / "a.md").write_text("# Page A\n\n## Two words, `code`\n\nSee [b](b.md#real-heading).\n")
    (docs / "b.md").write_text("# B\n\n## Real heading\n\n[bad](a.md#nowhere) [gone](missing.md) `[x](code.md)`\n")
    (docs / "index.md").write_text("[A](a.md)\n\n```\n[B](b.md)\n```\n")
    assert anchors((docs / "a.md").read_text()) == {"page-a", "two-words-code"}
    assert broken_links(docs / "a.md", tmp_path) == []
    assert broken_links(docs / "b.md", tmp_path) == [
        "a.md#nowhere: no heading with that anchor in a.md",
        "missing.md: no such file",
    ]
    assert pages_missing_from_index(docs / "index.md", sorted(docs.glob("*.md"))) == ["b.md"]
    outside = tmp_path / "outside.md"
    outside.write_text("x")
    (docs / "c.md").write_text("[out](../outside.md) [web](https://example.com/x.md)\n")
    assert broken_links(docs / "c.md", docs) == ["../outside.md: outside docs"]
    with pytest.raises(ValueError, match="lacks the markers"):
        page_with_reference("# a page without markers\n")
    stale = f"intro\n{START}\n| key |\n{END}\nafter\n"
    assert page_with_reference(stale) != stale
    assert page_with_reference(page_with_reference(stale)) == page_with_reference(stale)
