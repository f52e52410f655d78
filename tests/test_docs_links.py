"""Every relative link in README.md and docs/*.md resolves: the file exists and, for a
`#anchor`, the target page has a heading with that anchor under GitHub's rules (lower case,
punctuation dropped, spaces to hyphens, `-1`, `-2` for repeats). Whatever pages docs/ holds
are checked, those other changes add included."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from radixserve.model.families.registry import supported_architectures
from tests import model_table
from tests.repo import REPO_ROOT

_FENCE = re.compile(r"^(```|~~~)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
_LINK = re.compile(r"(?<!!)\[(?:[^\]\\]|\\.)*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HTML_ANCHOR = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading's text (before the -N suffix of repeats): markup
    reduced to its text, lower case, every character but letters, digits, `_`, `-` and
    spaces dropped, each space a hyphen."""
    text = _CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.lower()
    text = "".join(ch for ch in text if ch.isalnum() or ch in "_- ")
    return text.replace(" ", "-")


def _prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def anchors(text: str) -> set[str]:
    seen: Counter[str] = Counter()
    found: set[str] = set()
    for line in _prose_lines(text):
        found.update(_HTML_ANCHOR.findall(line))
        m = _HEADING.match(line)
        if m:
            base = github_anchor(m.group(2))
            found.add(base if not seen[base] else f"{base}-{seen[base]}")
            seen[base] += 1
    return found


def links(text: str) -> list[str]:
    """Link targets in prose: not in code blocks or code spans, images excluded."""
    prose = "\n".join(_prose_lines(text))
    prose = _CODE_SPAN.sub("", prose)
    return _LINK.findall(prose)


def broken_links(page: Path, root: Path) -> list[str]:
    """`page`'s relative links that do not resolve, each with the reason."""
    bad, root = [], root.resolve()
    for target in links(page.read_text(encoding="utf-8")):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:, ...
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            bad.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(
                dest.read_text(encoding="utf-8")):
            bad.append(f"{target}: no heading with anchor #{anchor} in {dest.name}")
        elif root not in dest.parents and dest != root:
            bad.append(f"{target}: outside the repository")
    return bad


PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert broken_links(page, REPO_ROOT) == []


def test_readme_links_into_docs_and_keeps_the_model_table_markers() -> None:
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 260, "README.md is meant to be read in five minutes"
    assert {t.partition("#")[0] for t in links(readme) if t.startswith("docs/")} >= {
        "docs/serving.md", "docs/agents.md", "docs/router.md", "docs/development.md"}
    begin, end = model_table.TABLE_BEGIN, model_table.TABLE_END
    assert readme.count(begin) == readme.count(end) == 1
    table = readme[readme.index(begin):readme.index(end)]
    for arch in supported_architectures():  # the registry's table (tests/model_table.py)
        assert f"`{arch}`" in table


def test_anchor_rules_and_a_broken_link_is_found(tmp_path: Path) -> None:
    assert github_anchor("Tensor parallelism (--tensor-parallel-size)") == \
        "tensor-parallelism---tensor-parallel-size"
    assert github_anchor("An 8-bit KV cache (`--kv-cache-dtype fp8`)") == \
        "an-8-bit-kv-cache---kv-cache-dtype-fp8"
    assert github_anchor("Sessions: a conversation stays where its cache is") == \
        "sessions-a-conversation-stays-where-its-cache-is"
    assert github_anchor("The [router](x.md) & fleets") == "the-router--fleets"
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text(
        "# Title\n## Notes\n## Notes\n```\n# not a heading\n```\n<a id=\"custom\"></a>\n")
    assert anchors((tmp_path / "docs" / "a.md").read_text()) == {
        "title", "notes", "notes-1", "custom"}
    page = tmp_path / "README.md"
    page.write_text("[ok](docs/a.md#notes-1) [ok](#top) ![img](missing.png) `[no](x.md)`\n"
                    "[bad](docs/a.md#not-a-heading) [gone](docs/b.md) [web](https://x.y/z)\n"
                    "```\n[code](nowhere.md)\n```\n# Top\n")
    assert broken_links(page, tmp_path) == [
        "docs/a.md#not-a-heading: no heading with anchor #not-a-heading in a.md",
        f"docs/b.md: no file {tmp_path.resolve() / 'docs' / 'b.md'}"]
