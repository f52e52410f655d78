"""The tiers on CUDA: the local tier is pinned host memory above the disk, loads run on their
own stream. Greedy tokens identical with tiers off, on, and after a restart (needs a GPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.cache.tiers.engine_runs import prompts, run

pytestmark = pytest.mark.gpu


def test_cuda_tiers_keep_greedy_tokens(tier_model: Path, tmp_path: Path) -> None:
    from radixserve import LLM

    def make(**kw: Any) -> LLM:
        return LLM(model=str(tier_model), dtype="float32", device="cuda", kv_cache_tokens=600,
                   max_model_len=512, **kw)

    batch = prompts(4, 300)
    again = batch + batch
    base, _ = run(make(), again)
    llm = make(kv_offload_dir=tmp_path, kv_offload_host_size=0.001)
    assert llm.engine.info["kv_offload"]["host_size_bytes"] > 0
    outs, cached = run(llm, again)
    assert outs == base and all(c >= 288 for c in cached[4:]), cached
    llm.close()
    restarted = make(kv_offload_dir=tmp_path)
    outs, cached = run(restarted, batch)
    assert outs == base[:4] and all(c >= 288 for c in cached), cached
    restarted.close()


def test_cuda_chooses_the_host_tier_and_not_a_slow_disk(tier_model: Path, tmp_path: Path) -> None:
    """On a GPU prefill is cheap: the host layer's pinned blocks (one async copy each) are
    still worth loading, a disk slowed to 50 ms per operation is not (measured, no bypass;
    host memory is its own tier in the choice, Tier.HOST)."""
    from radixserve import LLM
    from radixserve.cache.tiers import BlockStore, Tier
    from radixserve.cache.tiers.layered_store import LayeredStore
    from tests.cache.tiers.engine_runs import warm_choice

    def make(root: Path, host_gib: float) -> LLM:
        return LLM(model=str(tier_model), dtype="float32", device="cuda", kv_cache_tokens=4096,
                   max_model_len=512, kv_offload_dir=root, kv_offload_host_size=host_gib)

    batch = prompts(3, 300, seed=31)
    fast = make(tmp_path / "host", 1.0)  # the host layer holds every block
    warm_choice(fast, batch)
    _, cached = run(fast, batch)
    assert cached == [288] * 3, cached
    assert fast.engine.tiers is not None
    counts = fast.engine.tiers.choice.counts
    assert counts[Tier.HOST]["recompute"] == 0 and counts[Tier.HOST]["load"] >= 3, counts
    fast.close()
    slow = make(tmp_path / "disk", 1e-6)  # host layer too small: every block on the disk
    warm_choice(slow, batch)
    tiers = slow.engine.tiers
    assert tiers is not None and tiers.writer.flush()
    store = tiers.stores[Tier.LOCAL]
    assert isinstance(store, LayeredStore) and isinstance(store.disk, BlockStore)
    store.disk.files.delay_s = 0.05
    _, cached = run(slow, batch, check=False)  # one slow load measures the disk
    assert cached[1:] == [0, 0], cached
    assert tiers.choice.counts[Tier.LOCAL]["recompute"] >= 2
    store.disk.files.delay_s = 0.0
    slow.close()
