"""Every relative link in README.md and docs/ resolves: the file exists, the anchor is a heading;
every repository path the pages name (``fedddl/...``, ``tests/...``, ...) exists.

Anchors follow GitHub's rule: the heading's text lower-cased, everything but letters, digits,
spaces, hyphens and underscores dropped, spaces turned into hyphens, a repeat suffixed ``-1``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]*)(?:\s+\"[^\"]*\")?\)")
_REPO_PATH = re.compile(
    r"(?<![\w./-])((?:fedddl|strategies|clients|tests|simulations|docs)/[\w./*-]*[\w/*])"
)
_HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)


def _prose(text: str) -> str:
    """The page without fenced code blocks and inline code spans."""
    return _INLINE_CODE.sub("", _FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for one heading's text."""
    text = re.sub(r"`([^`]*)`", r"\1", heading)
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every heading anchor of a Markdown page, repeats numbered as GitHub does."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for heading in _HEADING.findall(_FENCE.sub("", page.read_text(encoding="utf-8"))):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def links(page: Path) -> list[str]:
    """Relative link targets of a page (external URLs left out)."""
    targets = _LINK.findall(_prose(page.read_text(encoding="utf-8")))
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def test_slug_follows_github() -> None:
    assert slug("Real slow links (testbed)") == "real-slow-links-testbed"
    assert slug("3. Gossip, 16 nodes: random vs random+overlap") == (
        "3-gossip-16-nodes-random-vs-randomoverlap"
    )
    assert slug("Ternary gradients (`fedddl.compression`)") == "ternary-gradients-fedddlcompression"


def test_link_finder_sees_links_and_skips_code() -> None:
    page = "[a](x.md) ![b](y.png) `[c](z.md)` [d](https://e.org)\n```\n[f](g.md)\n```\n"
    assert _LINK.findall(_prose(page)) == ["x.md", "y.png", "https://e.org"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading with that anchor")
        elif not path and not anchor:
            broken.append(f"{target!r}: empty link")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_readme_links_every_docs_page() -> None:
    """Each page under docs/ (the results reports aside) is reachable from the README."""
    readme_targets = {t.partition("#")[0] for t in links(ROOT / "README.md")}
    pages = [p for p in (ROOT / "docs").glob("*.md")]
    missing = [p.name for p in pages if f"docs/{p.name}" not in readme_targets]
    assert not missing, missing


def test_path_finder_sees_paths_in_prose_and_code() -> None:
    text = "see `fedddl/sync/server.py`\n  python simulations/run.py --out results/x a/fedddl/no"
    assert _REPO_PATH.findall(text) == ["fedddl/sync/server.py", "simulations/run.py"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_repository_path_named_exists(page: Path) -> None:
    """A moved or renamed module shows up here with the page that still names it."""
    missing = []
    for name in sorted(set(_REPO_PATH.findall(page.read_text(encoding="utf-8")))):
        found = any(ROOT.glob(name)) if "*" in name else (ROOT / name).exists()
        if not found:
            missing.append(name)
    assert not missing, f"{page.relative_to(ROOT)} names paths that do not exist: {missing}"
