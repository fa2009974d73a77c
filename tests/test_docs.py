"""The docs cite only what the repository holds (issue 31).

Every repository path a page names (``src/...``, ``tests/...``, ``benchmarks/...``,
``examples/...``, ``docs/...``, ``deploy/...``: in inline code, a code block, a link or plain
text), and every relative link, must exist; ``path::test_name`` must name a test function of that file.
No page, and no file of the repository, may point outside it (a design note or a ``shared``
directory beside the checkout that a reader of the repository does not have). docs/index.md
links every page once.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
TOP = ("src", "tests", "benchmarks", "examples", "docs", "deploy")
#: a repository path anywhere in a page: ``src/onceflow/faults.py``,
#: ``tests/sinks/test_conformance.py::test_crash_windows``
PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(TOP)})/[\w./-]*[\w/])(?:::(\w+))?")
LINK = re.compile(r"\]\(([^)\s]+)\)")
#: what no file may name (spelt in pieces so that this file does not name it either)
OUTSIDE = ("DESIGN" + ".md", "../" + "shared")


def cited(page: Path) -> list[tuple[Path, str | None]]:
    """(file, test name or None) for everything ``page`` cites: repository paths anywhere in
    it, and the targets of its relative links (resolved from the page's directory)."""
    text = page.read_text()
    out = [(ROOT / p, test) for p, test in PATH.findall(text) if "*" not in p]
    for target in LINK.findall(text):
        if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, or an anchor on the same page
        out.append(((page.parent / target.split("#")[0]).resolve(), None))
    return out


def missing(pages: list[Path]) -> list[str]:
    """``page: path`` for every cited path (or test) that does not exist."""
    out = []
    for page in pages:
        for where, test in cited(page):
            name = str(where.relative_to(ROOT)) if where.is_relative_to(ROOT) else str(where)
            if not where.exists():
                out.append(f"{page.name}: {name}")
            elif test and where.is_file() and not re.search(rf"^(async )?def {test}\(", where.read_text(), re.M):
                out.append(f"{page.name}: {name}::{test}")
    return sorted(set(out))


def test_every_path_the_docs_cite_exists():
    assert len(PAGES) >= 19
    assert sum(len(cited(p)) for p in PAGES) > 100, "the scanner finds the docs' citations"
    assert missing(PAGES) == []


def test_the_scanner_catches_a_missing_file_and_a_missing_test(tmp_path):
    page = tmp_path / "page.md"
    (tmp_path / "there.md").write_text("here")
    page.write_text("See `src/onceflow/nothing_here.py`, [a page](there.md#a), src/onceflow/faults.py,\n"
                    "[gone](gone.md) and `tests/sinks/test_conformance.py::test_nope`.\n"
                    "```\npython benchmarks/bench_nothing.py\n```\n")
    found = missing([page])
    assert any("src/onceflow/nothing_here.py" in m for m in found), found
    assert any("bench_nothing.py" in m for m in found), found
    assert any(m.endswith("gone.md") for m in found), found
    assert any("::test_nope" in m for m in found), found
    assert len(found) == 4, found  # the page that exists, and faults.py, are fine


def test_nothing_points_outside_the_repository():
    files = PAGES + [ROOT / "CHANGELOG.md"] + [f for top in ("src", "tests", "examples", "benchmarks", "deploy")
                                                for f in (ROOT / top).rglob("*") if f.suffix in (".py", ".md")]
    named = [f"{f.relative_to(ROOT)}: {word}" for f in files for word in OUTSIDE if word in f.read_text()]
    assert named == []


def test_the_index_links_every_page_once():
    index = (ROOT / "docs" / "index.md").read_text()
    links = [t.split("#")[0] for t in LINK.findall(index) if not re.match(r"[a-z]+:", t)]
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "index.md")
    assert sorted(t for t in links if t in pages) == pages, "each page linked exactly once"
    assert "docs/index.md" in (ROOT / "README.md").read_text()
