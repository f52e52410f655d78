"""The tiers on CUDA: the local tier is pinned host memory above the disk, loads run on their
own stream. Greedy tokens identical with tiers off, on, and after a restart (needs a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.cache.tiers.test_engine import prompts, run

pytestmark = pytest.mark.gpu


def test_cuda_tiers_keep_greedy_tokens(tier_model: Path, tmp_path: Path) -> None:
    from radixserve import LLM

    def make(**kw: object) -> LLM:
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
