"""The documentation's relative links reach existing files and headings, and the README opens with CI's commands."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 150

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """``text`` without fenced blocks and code spans, where brackets are code, not links."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = _CODE_SPAN.sub(lambda m: m.group(0)[1:-1], heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    headings = re.findall(r"^#{1,6} (.+)$", _FENCE.sub("", page.read_text()), re.M)
    return {_anchor(h) for h in headings}


def _relative_links(page: Path) -> list[str]:
    return [t for t in _LINK.findall(_prose(page.read_text())) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_reach_files_and_headings(page: Path) -> None:
    broken = []
    for target in _relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no file {dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest}")
        elif anchor and (dest.suffix != ".md" or anchor not in _anchors(dest)):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not broken, f"{page.relative_to(ROOT)} has broken links:\n" + "\n".join(broken)


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _relative_links(ROOT / "README.md")}
    unlinked = [p.name for p in PAGES[2:] if p.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def _ci_commands() -> list[str]:
    """The commands .ci/run runs after the set-up, without their environment assignments."""
    lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    start = lines.index("bash scripts/setup.sh")
    return [re.sub(r'^(\w+=("[^"]*"|\S+) )+', "", line) for line in lines[start + 1 :] if line]


def test_readme_opens_with_the_ci_commands() -> None:
    commands = _ci_commands()
    assert commands, ".ci/run runs nothing after bash scripts/setup.sh"
    blocks = re.findall(r"^```bash\n(.*?)\n```", (ROOT / "README.md").read_text(), re.S | re.M)
    assert blocks[: len(commands)] == [f"bash scripts/setup.sh && {command}" for command in commands]


def test_readme_is_short() -> None:
    lines = (ROOT / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move detail into docs/ (at most {README_MAX_LINES})"
