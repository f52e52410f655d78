"""The tiers' model identity: one name, other weights (a fine-tune of the same shapes, same
file names and sizes) is another identity, so their blocks are never shared."""

from __future__ import annotations

from pathlib import Path

from radixserve.engine.tiers_setup import SAMPLE_HEAD, model_identity


def write_model(root: Path, weights: bytes) -> Path:
    root.mkdir()
    (root / "config.json").write_text('{"hidden_size": 8}')
    (root / "model.safetensors").write_bytes(weights)
    (root / "README.md").write_text("not a weight file")
    return root


def test_same_shapes_other_weights_are_another_identity(tmp_path: Path) -> None:
    size = 3 * SAMPLE_HEAD
    base = bytes(range(256)) * (size // 256)
    tuned = bytearray(base)
    tuned[size // 2 - 1] ^= 0xFF  # a sampled byte (a fine-tune differs everywhere)
    a = model_identity("m", write_model(tmp_path / "a", base))
    b = model_identity("m", write_model(tmp_path / "b", bytes(tuned)))
    again = model_identity("m", write_model(tmp_path / "c", base))
    assert a != b and a == again and a.startswith("m#")
    (tmp_path / "c" / "README.md").write_text("docs change nothing")
    assert model_identity("m", tmp_path / "c") == a
    assert model_identity("other", tmp_path / "a") != a
