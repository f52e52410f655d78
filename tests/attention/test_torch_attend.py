"""The torch backend's attend() (attention over K/V the model stored itself: norm_rope's
rope_store on CPU) against forward() (which stores them first): the same output bit for bit
and no store of its own, for decode steps (with and without shared groups, a sliding window,
a soft-cap), short chunks, and a batch with a long prefill chunk (its own K/V read back from
the pool)."""

from __future__ import annotations

import pytest
import torch

from radixserve.attention.base import StoredKVAttention
from radixserve.attention.cpu_kernels import load_paged_decode, load_prefill_attention
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.attention.varlen import MIN_VARLEN_TOKENS
from radixserve.types import Phase
from tests.attention.test_torch_backend import HKV, NUM_SLOTS, D, G, build_meta, make_table

# every test under each CPU tier this host executes (tests/conftest.py's cpu_tier)
pytestmark = pytest.mark.usefixtures("cpu_tier")

CASES = {  # prefix_lens, extend_lens, shared groups (members, length), phase
    "decode": ([40, 17, 63], [1, 1, 1], [], Phase.DECODE),
    "decode-groups": ([40, 44, 9], [1, 1, 1], [([0, 1], 32)], Phase.DECODE),
    "short-chunks": ([0, 12, 30], [5, 3, 1], [], Phase.PREFILL),
    "long-chunk-mixed": ([0, 20, 33], [MIN_VARLEN_TOKENS + 9, 1, 4], [], Phase.PREFILL),
}


def backends() -> tuple[TorchAttentionBackend, TorchAttentionBackend]:
    paged, prefill = load_paged_decode(), load_prefill_attention()
    assert paged is not None and prefill is not None, "the kernels build where tests run"
    return TorchAttentionBackend(paged, prefill), TorchAttentionBackend(paged, prefill)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("limits", [(None, None), (24, None), (None, 30.0)],
                         ids=["causal", "window", "softcap"])
@pytest.mark.parametrize("case", list(CASES))
def test_attend_equals_forward_over_the_stored_kv(case: str, limits: tuple[int | None,
                                                                           float | None],
                                                  dtype: torch.dtype) -> None:
    prefix, extend, groups, phase = CASES[case]
    window, softcap = limits
    gen = torch.Generator().manual_seed(len(case) + 7 * len(extend))
    seq = [p + n for p, n in zip(prefix, extend, strict=True)]
    table = make_table(seq, groups, consecutive=False, gen=gen)
    meta = build_meta(phase, prefix, extend, table, groups)
    T = sum(extend)
    q = torch.randn(T, HKV * G, D, generator=gen).to(dtype)
    k = torch.randn(T, HKV, D, generator=gen).to(dtype)
    v = torch.randn(T, HKV, D, generator=gen).to(dtype)
    k_cache = torch.randn(NUM_SLOTS, HKV, D, generator=gen).to(dtype)  # the prefixes' K/V
    v_cache = torch.randn(NUM_SLOTS, HKV, D, generator=gen).to(dtype)
    stored_k, stored_v = k_cache.clone(), v_cache.clone()
    stored_k[meta.out_slots], stored_v[meta.out_slots] = k, v  # as rope_store leaves them
    by_forward, by_attend = backends()
    assert isinstance(by_attend, StoredKVAttention) and not by_attend.fused_kernels
    want = by_forward.forward(q, k, v, k_cache, v_cache, meta, 0.17, window=window,
                              softcap=softcap)
    assert torch.equal(k_cache, stored_k) and torch.equal(v_cache, stored_v)
    # q as the layer hands it over: a view of its qkv rows, rows wider than the heads
    qkv = torch.cat([q.flatten(1), torch.randn(T, 2 * HKV * D, generator=gen).to(dtype)], 1)
    got = by_attend.attend(qkv[:, : HKV * G * D].view(T, HKV * G, D), stored_k, stored_v, meta,
                           0.17, window=window, softcap=softcap)
    assert torch.equal(got, want)
    assert torch.equal(k_cache, stored_k) and torch.equal(v_cache, stored_v)  # nothing stored


def test_attend_checks_its_options_on_the_first_layer_only() -> None:
    _, backend = backends()
    meta = build_meta(Phase.DECODE, [3], [1], torch.arange(8, dtype=torch.int32).view(1, 8), [])
    q, cache = torch.randn(1, HKV * G, D), torch.randn(NUM_SLOTS, HKV, D)
    with pytest.raises(ValueError, match="sliding window"):
        backend.attend(q, cache, cache, meta, 0.1, window=0)
    with pytest.raises(ValueError, match="soft-cap"):
        backend.attend(q, cache, cache, meta, 0.1, softcap=-1.0)
