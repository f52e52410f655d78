"""The Triton decode and extend kernels with a sliding window and a logit soft-cap against
their plain-torch references (under the interpreter on CPU; see test_kernels.py), and the
Triton backend against the torch backend with both options.

Unowned cache slots are NaN and outputs NaN-filled before a launch, as in test_kernels.py: a
kernel reading a slot outside a request, or leaving a row unwritten, shows up as NaN.
"""

from __future__ import annotations

import pytest
import torch

from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.attention.triton_backend import TritonAttentionBackend
from radixserve.types import Phase
from tests.attention.test_triton_backend import make_meta
from tests.triton_kernels.test_kernels import (
    BF16,
    DEVICE,
    DEVICE_ERROR,
    F32,
    TOL,
    make_cache,
    make_paged,
    randn,
    rel_err,
    upcast,
)
from triton_kernels import decode_attention, extend_attention
from triton_kernels.reference import decode_attention_ref, extend_attention_ref


@pytest.fixture
def runnable_kernels() -> None:
    if DEVICE_ERROR:
        pytest.fail(DEVICE_ERROR, pytrace=False)


# window, softcap: a window shorter than a KV block, one across blocks, a cap alone, both
OPTIONS = [(5, None), (70, None), (None, 1.5), (33, 1.5)]


@pytest.mark.usefixtures("runnable_kernels")
@pytest.mark.parametrize(("window", "softcap"), OPTIONS)
@pytest.mark.parametrize(("dtype", "splits"), [(F32, 3), (BF16, None)])
def test_decode_window_softcap_matches_reference(window: int | None, softcap: float | None,
                                                 dtype: torch.dtype, splits: int | None) -> None:
    gen = torch.Generator().manual_seed(11)
    lens, kv_heads, group, head_dim = [1, 15, 65, 200], 2, 3, 64
    paged = make_paged(lens, 16, gen)
    k_cache, v_cache = make_cache(paged, kv_heads, head_dim, dtype, gen)
    q = randn((len(lens), kv_heads * group, head_dim), dtype, gen) * 3
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k_cache, v_cache, paged.slot_table, paged.rows, seq_lens, 0.125,
                     num_splits=splits, out=out, window=window, softcap=softcap)
    qf, kf, vf = upcast(q, k_cache, v_cache)
    ref = decode_attention_ref(qf, kf, vf, paged.slot_table, paged.rows, seq_lens, 0.125,
                               window=window, softcap=softcap)
    assert rel_err(out, ref) <= TOL[dtype]
    plain = decode_attention_ref(qf, kf, vf, paged.slot_table, paged.rows, seq_lens, 0.125)
    assert rel_err(plain, ref) > 1e-3  # the options change the result on these inputs


@pytest.mark.usefixtures("runnable_kernels")
@pytest.mark.parametrize(("window", "softcap"), OPTIONS)
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_extend_window_softcap_matches_reference(window: int | None, softcap: float | None,
                                                 dtype: torch.dtype) -> None:
    """Chunks longer than the window (rows of a program that see nothing of its first
    blocks), behind cached prefixes longer than the window, and single tokens."""
    gen = torch.Generator().manual_seed(12)
    reqs, kv_heads, group, head_dim = [(0, 37), (16, 1), (100, 80), (5, 16)], 1, 3, 64
    paged = make_paged([p + n for p, n in reqs], 16, gen)
    k_cache, v_cache = make_cache(paged, kv_heads, head_dim, dtype, gen)
    ints = {"dtype": torch.int32, "device": DEVICE}
    prefix_lens = torch.tensor([p for p, _ in reqs], **ints)
    extend_lens = torch.tensor([n for _, n in reqs], **ints)
    cu = torch.zeros(len(reqs) + 1, **ints)
    cu[1:] = extend_lens.cumsum(0)
    q = randn((int(extend_lens.sum()), kv_heads * group, head_dim), dtype, gen) * 3
    out = torch.full_like(q, float("nan"))
    extend_attention(q, k_cache, v_cache, paged.slot_table, paged.rows, prefix_lens,
                     extend_lens, cu, 80, 0.125, out=out, window=window, softcap=softcap)
    qf, kf, vf = upcast(q, k_cache, v_cache)
    ref = extend_attention_ref(qf, kf, vf, paged.slot_table, paged.rows, prefix_lens,
                               extend_lens, cu, 0.125, window=window, softcap=softcap)
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.usefixtures("runnable_kernels")
def test_backend_window_softcap_matches_torch_backend() -> None:
    """A prefill over a cached prefix longer than the window, then a decode step, through
    both backends; a global layer (no options) between them in the same forward."""
    gen = torch.Generator().manual_seed(5)
    kv_heads, group, head_dim, num_slots = 2, 2, 32, 512
    prefix_lens, extend_lens, rows = [0, 90, 40], [30, 1, 20], [1, 0, 2]
    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
    free = (torch.randperm(num_slots - 1, generator=gen)[: sum(seq_lens) + 3] + 1).tolist()
    table = torch.zeros(3, 128, dtype=torch.int32, device=DEVICE)
    for row, n in zip(rows, seq_lens, strict=True):
        table[row, : n + 1] = torch.tensor([free.pop() for _ in range(n + 1)],
                                           dtype=torch.int32)
    pool = (randn((num_slots, kv_heads, head_dim), F32, gen),
            randn((num_slots, kv_heads, head_dim), F32, gen))
    steps = [(Phase.PREFILL, prefix_lens, extend_lens), (Phase.DECODE, seq_lens, [1, 1, 1])]
    for phase, prefixes, extends in steps:
        out_slots = torch.cat([table[r, p : p + n]
                               for r, p, n in zip(rows, prefixes, extends, strict=True)])
        meta = make_meta(phase, prefixes, extends, rows, table, out_slots.long())
        t = sum(extends)
        q = randn((t, kv_heads * group, head_dim), F32, gen) * 3
        k = randn((t, kv_heads, head_dim), F32, gen)
        v = randn((t, kv_heads, head_dim), F32, gen)
        for window, softcap in [(24, 2.0), (None, None)]:
            ours = TritonAttentionBackend(2).forward(q, k, v, *pool, meta, 0.2, window=window,
                                                     softcap=softcap)
            ref = TorchAttentionBackend().forward(q, k, v, *pool, meta, 0.2, window=window,
                                                  softcap=softcap)
            assert rel_err(ours, ref) <= 1e-5
