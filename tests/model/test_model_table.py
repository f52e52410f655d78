"""docs/models.md's model table is the registry's: regenerate with
`python -m tests.model_table --write`."""

from __future__ import annotations

from radixserve.model.families.registry import supported_architectures
from tests import model_table


def test_docs_table_is_the_generated_one() -> None:
    text = model_table.DOC.read_text(encoding="utf-8")
    assert model_table.doc_section(text) == model_table.model_table(), (
        "docs/models.md's model table is stale: run `python -m tests.model_table --write`")


def test_every_supported_architecture_has_a_row() -> None:
    table = model_table.model_table()
    for arch in supported_architectures():
        assert f"`{arch}`" in table
