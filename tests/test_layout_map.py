"""The layout map (docs/development.md's) is the tree's: every module listed (by its docstring's first line), no
module listed that does not exist, and a read-first path of files that exist. Regenerate with
`python -m tests.layout_map --write`."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests import layout_map
from tests.layout_map import LAYOUT_BEGIN, LAYOUT_END, LayoutError
from tests.repo import REPO_ROOT


def test_the_pages_map_is_the_generated_one() -> None:
    page = (REPO_ROOT / layout_map.MAP_PAGE).read_text(encoding="utf-8")
    assert layout_map.page_section(page) == layout_map.layout_map(), (
        f"{layout_map.MAP_PAGE}'s layout map is stale: run `python -m tests.layout_map --write`")


def test_every_module_is_in_the_map_and_every_listed_one_exists() -> None:
    text = layout_map.layout_map()
    for tree in layout_map.TREES:
        for path in (REPO_ROOT / tree).rglob("*.py"):
            if "__pycache__" in path.parts or path.name == "__init__.py":
                continue
            line = f"`{path.name}`: {layout_map.first_line(path)}"
            assert line in text, f"{path.relative_to(REPO_ROOT)} is missing from the map"
    assert "`bench/`" in text and "`common/`" in text and "`offline.py`" in text


def test_read_first_path_files_exist() -> None:
    assert 8 <= len(layout_map.READ_FIRST) <= 14  # about ten files, route to sampled token
    for path, _ in layout_map.READ_FIRST:
        assert (REPO_ROOT / path).is_file(), path
    paths = [p for p, _ in layout_map.READ_FIRST]
    assert paths[0] == "radixserve/server/routes/chat.py"
    assert "radixserve/sched/scheduler.py" in paths and "radixserve/engine/sampler.py" in paths


@pytest.fixture
def tree_copy(tmp_path: Path) -> Path:
    """A copy of the mapped trees and the map's page, to change without touching the checkout."""
    for tree in layout_map.TREES:
        shutil.copytree(REPO_ROOT / tree, tmp_path / tree,
                        ignore=shutil.ignore_patterns("__pycache__", "csrc", "deploy"))
    (tmp_path / "docs").mkdir()
    shutil.copy(REPO_ROOT / layout_map.MAP_PAGE, tmp_path / layout_map.MAP_PAGE)
    return tmp_path


def _section(root: Path) -> str:
    return layout_map.page_section((root / layout_map.MAP_PAGE).read_text(encoding="utf-8"))


def test_a_new_module_a_removed_one_and_a_reworded_line_all_show(tree_copy: Path) -> None:
    assert _section(tree_copy) == layout_map.layout_map(tree_copy)
    new = tree_copy / "radixserve" / "sched" / "fresh.py"
    new.write_text('"""Fresh: a module the map does not know yet."""\n')
    assert _section(tree_copy) != layout_map.layout_map(tree_copy)
    assert layout_map.write_page(tree_copy)
    assert "`fresh.py`: Fresh: a module the map does not know yet." in _section(tree_copy)
    assert not layout_map.write_page(tree_copy)  # idempotent
    new.unlink()
    assert "fresh.py" not in layout_map.layout_map(tree_copy)
    assert _section(tree_copy) != layout_map.layout_map(tree_copy)
    assert layout_map.write_page(tree_copy)
    page = (tree_copy / layout_map.MAP_PAGE).read_text(encoding="utf-8")
    assert page == (REPO_ROOT / layout_map.MAP_PAGE).read_text(encoding="utf-8")


def test_a_module_without_docstring_or_a_missing_read_first_file_fails(
        tree_copy: Path) -> None:
    (tree_copy / "router" / "bare.py").write_text("from __future__ import annotations\n")
    with pytest.raises(LayoutError, match="bare.py has no module docstring"):
        layout_map.layout_map(tree_copy)
    (tree_copy / "router" / "bare.py").unlink()
    (tree_copy / "radixserve" / "engine" / "sampler.py").unlink()
    with pytest.raises(LayoutError, match="sampler.py"):
        layout_map.layout_map(tree_copy)


def test_a_data_folder_is_skipped_and_code_without_init_fails(tree_copy: Path) -> None:
    results = tree_copy / "bench" / "results"
    results.mkdir(exist_ok=True)
    (results / "run.json").write_text("{}")
    assert _section(tree_copy) == layout_map.layout_map(tree_copy)
    loose = tree_copy / "router" / "loose"
    loose.mkdir()
    (loose / "mod.py").write_text('"""Loose: a module outside any package."""\n')
    with pytest.raises(LayoutError, match="loose/ is no package"):
        layout_map.layout_map(tree_copy)


def test_markers_must_each_appear_once() -> None:
    with pytest.raises(LayoutError):
        layout_map.page_section(f"{LAYOUT_BEGIN}\nx\n")
    assert layout_map.page_section(f"a\n{LAYOUT_BEGIN}\nbody\n{LAYOUT_END}\nb") == "body\n"
