"""model/weight_memory.py and the loader's side of it: the weights own anonymous memory (not
the checkpoint's file mapping), the walk finds every large CPU tensor (oneDNN's prepacked ones
too), and the engine's weights end up madvised into 2 MB pages where THP allows it, with a
fallback (4 KB pages, nothing advised) where it does not."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve import LLM
from radixserve.model.cpu_linear import ENV_PANEL, Linear
from radixserve.model.families.registry import read_model_spec
from radixserve.model.weight_memory import (
    ENV_HUGE_PAGES,
    MIN_BYTES,
    place_weights,
    tensor_range,
    weight_ranges,
)
from radixserve.model.weights import load_weights
from radixserve.platform.huge_pages import advised_huge, read_smaps, thp_mode
from tests.tiny_models import make_tiny_model

THP_ON = thp_mode() in ("always", "madvise")
needs_smaps = pytest.mark.skipif(not read_smaps(), reason="no /proc/self/smaps")


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """fp32, tied, every linear above MIN_BYTES (the tests' tiny models are all below it)."""
    return make_tiny_model(tmp_path_factory.mktemp("wide"), "llama", hidden_size=512,
                           num_layers=1, num_heads=8, num_kv_heads=2, vocab_size=1024,
                           tie_word_embeddings=True)


@needs_smaps
def test_loaded_fp32_weights_leave_the_checkpoint_mapping(wide_model: Path) -> None:
    weights = load_weights(wide_model, read_model_spec(wide_model), torch.float32,
                           torch.device("cpu"), show_progress=False)
    maps = read_smaps()
    for t in (weights.embed, weights.layers[0].input_norm, weights.layers[0].o_proj):
        assert isinstance(t, torch.Tensor)
        addr = t.data_ptr()
        (m,) = [m for m in maps if m.start <= addr < m.end]
        assert m.anonymous, f"a weight in {m.path!r}: 4 KB page cache, not ours to advise"


def test_walk_finds_plain_and_prepacked_weights_once() -> None:
    big = torch.randn(1024, 256)  # 1 MB
    plain = Linear(big, torch.randn(1024), prepacked=False, panel=None)
    packed = Linear(torch.randn(512, 256), prepacked=True, panel=None)
    small = Linear(torch.randn(16, 16), prepacked=False, panel=None)
    ranges = weight_ranges([plain, {"again": plain, "tied": big}, (packed, small)])
    assert (big.data_ptr(), big.numel() * 4) in ranges
    expected = [tensor_range(big)]
    if packed.packed is not None:
        assert packed.packed.is_mkldnn
        expected.append(tensor_range(packed.packed))
    else:
        assert packed.weight is not None
        expected.append(tensor_range(packed.weight))
    assert sorted(ranges) == sorted(expected)  # no bias (4 KB), no small weight, no repeat
    assert all(n >= MIN_BYTES for _, n in ranges)


def test_views_cover_their_extent() -> None:
    base = torch.zeros(8, 1024)
    assert tensor_range(base[2:4]) == (base[2].data_ptr(), 2 * 1024 * 4)
    assert tensor_range(base[:, :2]) == (base.data_ptr(), (7 * 1024 + 2) * 4)


@needs_smaps
def test_never_falls_back_to_small_pages() -> None:
    w = torch.ones(1024, 1024)
    hg = [(m.start, m.end) for m in read_smaps() if "hg" in m.flags]  # earlier tests' too
    pages = place_weights([Linear(w, prepacked=False, panel=None)], mode="never")
    assert pages is not None and pages.advice.advised == 0 and pages.huge == 0
    assert pages.describe().startswith("4 KB pages")
    assert [(m.start, m.end) for m in read_smaps() if "hg" in m.flags] == hg  # nothing advised


def test_opt_out(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_HUGE_PAGES, "0")
    assert place_weights([Linear(torch.ones(1024, 1024), prepacked=False, panel=None)]) is None


@pytest.mark.skipif(not THP_ON, reason="transparent huge pages off or not Linux")
@pytest.mark.parametrize("panel", ["0", "1"])
def test_engine_weights_are_madvised_huge(wide_model: Path, panel: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_PANEL, panel)  # our panels vs oneDNN's prepacked weights
    llm = LLM(model=str(wide_model), dtype="float32", kv_cache_tokens=1024)
    try:
        runner = llm.engine.runner
        ranges = weight_ranges(runner.model)
        assert sum(n for _, n in ranges) >= 1024 * 512 * 4  # the embedding at least
        maps = read_smaps()
        missed = [(hex(a), n, [(hex(m.start), hex(m.end), m.path, " ".join(m.flags)) for m in maps
                               if m.start < a + n and a < m.end])
                  for a, n in ranges if not advised_huge([(a, n)], maps)]
        assert not missed, (runner.weight_pages, missed)
        pages = runner.weight_pages
        assert pages is not None and pages.advice.mode == thp_mode()
        info = llm.engine.info["weight_huge_pages"]
        assert info["thp"] == thp_mode() and info["advised_bytes"] >= info["weight_bytes"]
    finally:
        llm.close()
