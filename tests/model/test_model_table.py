"""README's and docs/models.md's model tables are the registry's: regenerate with
`python -m tests.model_table --write`."""

from __future__ import annotations

from radixserve.model.families.registry import supported_architectures
from tests import model_table


def test_the_pages_tables_are_the_generated_one() -> None:
    for page in model_table.PAGES:
        text = page.read_text(encoding="utf-8")
        assert model_table.doc_section(text) == model_table.model_table(), (
            f"{page.name}'s model table is stale: run `python -m tests.model_table --write`")


def test_every_supported_architecture_has_a_row() -> None:
    table = model_table.model_table()
    for arch in supported_architectures():
        assert f"`{arch}`" in table
