"""An 8-bit KV pool with a tier (issue 42, defect 1): a block loaded back into a float8 pool
is copied as bytes (torch has no index_copy_ for float8, on CPU or CUDA). The same prompt,
flushed to the local tier and served again, loads its prefix and gives the same tokens."""

from __future__ import annotations

from pathlib import Path

import torch

from radixserve.cache.tiers.block_io import BLOCK, KVCodec
from tests.cache.tiers.engine_runs import make_llm, prompts, run, warm_choice


def test_codec_writes_a_block_into_a_float8_pool() -> None:
    k = torch.zeros(2, 4 * BLOCK, 1, 8, dtype=torch.float8_e4m3fn)  # (layers, slots, heads, dim)
    v = torch.zeros_like(k)
    src = torch.randn(2, 2, BLOCK, 1, 8).to(torch.float8_e4m3fn)  # (2, layers, BLOCK, h, d)
    codec = KVCodec(k, v)
    slots = list(range(2 * BLOCK, 3 * BLOCK))
    codec.write(KVCodec.payload(src), slots, 0)
    assert torch.equal(k[:, 2 * BLOCK:3 * BLOCK].view(torch.uint8), src[0].view(torch.uint8))
    assert torch.equal(v[:, 2 * BLOCK:3 * BLOCK].view(torch.uint8), src[1].view(torch.uint8))
    again = codec.snapshot(slots)  # (1, 2, layers, BLOCK, h, d)
    assert torch.equal(again[0].view(torch.uint8), src.view(torch.uint8))


def test_fp8_pool_with_a_local_tier_loads_and_keeps_tokens(tier_model: Path,
                                                           tmp_path: Path) -> None:
    llm = make_llm(tier_model, kv_cache_dtype="fp8", kv_offload_dir=tmp_path,
                   kv_cache_tokens=2048)
    warm_choice(llm, [])
    (prompt,) = prompts(1, 300, seed=5)
    first, _ = run(llm, [prompt])
    assert llm.engine.flush_cache()  # demotes the pool into the local tier
    again, cached = run(llm, [prompt])
    assert cached == [288] and again == first
    assert not llm.kv_stats()["kv_offload"]["errors"]
    llm.close()
