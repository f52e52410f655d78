"""Sliding-window attention and logit soft-capping (attention/base.py's per-call options) on
the CPU paths: the float64 references against transformers' own mask, the native decode and
prefill kernels (model-dtype and 8-bit pools) against those references, and the torch
backend's every path (cascade with shared groups, native kernels, long chunks) against a
per-request float64 reference with the window and the cap."""

from __future__ import annotations

import pytest
import torch
from transformers.masking_utils import sliding_window_causal_mask_function

from radixserve.attention.base import check_window_softcap, window_start
from radixserve.attention.cpu_kernels import (
    cap_scores,
    load_paged_decode,
    load_prefill_attention,
    paged_decode_reference,
    prefill_attention_reference,
)
from radixserve.attention.kv_quant import KVScale, dequantize, quantize, scales_from_amax
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.types import Phase
from tests.attention.test_cpu_kernels import make_inputs, prefill_inputs
from tests.attention.test_torch_backend import (
    CASES,
    HKV,
    NUM_SLOTS,
    D,
    G,
    build_meta,
    make_table,
)


def test_window_matches_transformers_mask() -> None:
    """The reference's visible keys (weight > 0) are transformers' sliding-window causal mask:
    query q sees kv iff q - window < kv <= q (itself and the window - 1 keys before)."""
    g = torch.Generator().manual_seed(1)
    m, p, window = 9, 5, 4
    q = torch.randn(m, 1, 4, generator=g, dtype=torch.float64)
    k = torch.randn(m, 1, 4, generator=g, dtype=torch.float64)
    pool = torch.randn(p, 1, 4, generator=g, dtype=torch.float64)
    seen = probs_of(q, k, pool, torch.arange(p, dtype=torch.int32), window, None) > 0
    hf_mask = sliding_window_causal_mask_function(window)
    for i in range(m):
        hf = [bool(hf_mask(0, 0, torch.tensor(p + i), torch.tensor(kv))) for kv in range(p + m)]
        assert seen[i].tolist() == hf
        assert hf.index(True) == window_start(p + i, window)


def probs_of(q: torch.Tensor, k: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor,
             window: int | None, softcap: float | None) -> torch.Tensor:
    """The reference's attention weights (M, P + M) of head 0: values one-hot per key."""
    m, p = q.shape[0], slots.numel()
    n = p + m
    eye = torch.eye(n, dtype=torch.float64)
    vals_pool = torch.zeros(pool.shape[0], 1, n, dtype=torch.float64)
    vals_pool[slots.long(), 0] = eye[:p]
    pool_k = torch.zeros(pool.shape[0], 1, n, dtype=torch.float64)
    pool_k[:, :, : pool.shape[2]] = pool
    kk = torch.zeros(m, 1, n, dtype=torch.float64)
    kk[:, :, : k.shape[2]] = k
    qq = torch.zeros(m, 1, n, dtype=torch.float64)
    qq[:, :, : q.shape[2]] = q
    out, _ = prefill_attention_reference(qq, kk, eye[p:, None, :], pool_k, vals_pool, slots,
                                         1.0, softcap=softcap, window=window)
    return out[:, 0]


def test_reference_window_and_cap_by_hand() -> None:
    """The references' weights written out: zero outside [p - W + 1, p], and softmax of
    softcap * tanh(s / softcap) inside."""
    g = torch.Generator().manual_seed(0)
    m, p, window, cap = 6, 4, 3, 0.7
    q = torch.randn(m, 1, 4, generator=g, dtype=torch.float64)
    k = torch.randn(m, 1, 4, generator=g, dtype=torch.float64)
    pool = torch.randn(p, 1, 4, generator=g, dtype=torch.float64)
    slots = torch.arange(p, dtype=torch.int32)
    probs = probs_of(q, k, pool, slots, window, cap)
    keys = torch.cat([pool[:, 0], k[:, 0]])  # (P + M, 4)
    for i in range(m):
        pos = p + i
        lo = pos - window + 1
        s = cap * torch.tanh((keys[lo : pos + 1] @ q[i, 0]) / cap)
        expect = torch.zeros(p + m, dtype=torch.float64)
        expect[lo : pos + 1] = torch.softmax(s, 0)
        torch.testing.assert_close(probs[i], expect)
    # the decode reference agrees at the last query (starts raised by the window)
    table = torch.arange(p + m, dtype=torch.int32)[None]
    kv = torch.cat([pool, k])
    vals = torch.eye(p + m, dtype=torch.float64)[:, None, :]
    dec, _ = paged_decode_reference(
        torch.cat([q[-1:], torch.zeros(1, 1, p + m - 4, dtype=torch.float64)], 2),
        torch.cat([kv, torch.zeros(p + m, 1, p + m - 4, dtype=torch.float64)], 2), vals,
        table, torch.tensor([0]), torch.tensor([p + m - window]), torch.tensor([p + m]), 1.0,
        softcap=cap)
    torch.testing.assert_close(dec[0, 0], probs[-1])


def test_options_are_validated() -> None:
    check_window_softcap(None, None)
    check_window_softcap(1, 0.5)
    with pytest.raises(ValueError, match="window"):
        check_window_softcap(0, None)
    with pytest.raises(ValueError, match="soft-cap"):
        check_window_softcap(None, 0.0)
    assert cap_scores(torch.tensor([1.0]), None).item() == 1.0


# --- native kernels -----------------------------------------------------------------------

@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(9, 3, 64), (8, 1, 16), (4, 2, 128)])
def test_decode_kernel_softcap(dtype: torch.dtype, tol: float, hq: int, hkv: int,
                               d: int) -> None:
    lens, starts = [1, 17, 300, 64], [0, 0, 250, 1]  # starts raised: a window of 50 on 300
    args = make_inputs(lens, starts, hq, hkv, d, dtype)
    op = load_paged_decode()
    assert op is not None
    q = args[0] * 4  # scores large enough for the cap to matter
    out, lse = op(q, *args[1:], d**-0.5, softcap=2.0)
    ref_out, ref_lse = paged_decode_reference(q, *args[1:], d**-0.5, softcap=2.0)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)
    uncapped, _ = paged_decode_reference(q, *args[1:], d**-0.5)
    assert not torch.allclose(uncapped.float(), ref_out.float(), atol=1e-2)


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 24])
def test_decode_kernel_softcap_fp8_pool(fmt: torch.dtype, dtype: torch.dtype, d: int) -> None:
    """Every 8-bit decode path (generic, AVX-512 blocked, AVX512-BF16; the AMX one defers)
    caps like the reference over the dequantized pool."""
    q, k, v, table, rows, starts, lens = make_inputs([5, 140, 77], [0, 12, 70], 8, 2, d, dtype)
    ks, vs = torch.full((2,), 0.05), torch.full((2,), 0.04)
    k8, v8 = quantize(k, ks, fmt), quantize(v, vs, fmt)
    op = load_paged_decode()
    assert op is not None
    q = q * 4
    out, lse = op(q, k8, v8, table, rows, starts, lens, d**-0.5, ks, vs, softcap=1.5)
    kd, vd = dequantize(k8, ks, dtype), dequantize(v8, vs, dtype)
    ref_out, ref_lse = paged_decode_reference(q, kd, vd, table, rows, starts, lens, d**-0.5,
                                              softcap=1.5)
    # bf16: the reference's keys are x * scale rounded to bf16, the kernels' scale the fp32 score
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse, ref_lse, rtol=tol, atol=tol)


PREFILL_WINDOW_CASES = [
    # m, p, window: a window inside one key block, across blocks, past the whole chunk,
    # of one token, and chunks longer than the window with and without a prefix
    (45, 0, 5), (100, 0, 33), (130, 0, 1), (64, 40, 200), (300, 31, 64), (257, 20, 128),
    (33, 9, 10),
]


@pytest.mark.parametrize(("dtype", "tol", "hq", "hkv", "d"), [
    (torch.float32, 2e-5, 9, 3, 64), (torch.float32, 2e-5, 6, 2, 32),
    (torch.bfloat16, 2e-2, 4, 1, 128), (torch.bfloat16, 2e-2, 9, 3, 64)])
@pytest.mark.parametrize(("m", "p", "window"), PREFILL_WINDOW_CASES)
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_prefill_kernel_window_and_softcap(dtype: torch.dtype, tol: float, hq: int, hkv: int,
                                           d: int, m: int, p: int, window: int,
                                           softcap: float | None) -> None:
    """The prefix as the backend passes it: only its slots inside the first query's window."""
    q, k, v, kc, vc, slots = prefill_inputs(m, p, hq, hkv, d, dtype)
    slots = slots[window_start(p, window):]
    op = load_prefill_attention()
    assert op is not None
    out, lse = op(q, k, v, kc, vc, slots, d**-0.5, softcap=softcap or 0.0, window=window)
    ref_out, ref_lse = prefill_attention_reference(q, k, v, kc, vc, slots, d**-0.5,
                                                   softcap=softcap, window=window)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(lse, ref_lse, rtol=1e-5, atol=1e-5)


def test_prefill_kernel_window_fp8_pool() -> None:
    q, k, v, kc, vc, slots = prefill_inputs(100, 70, 4, 2, 64, torch.bfloat16)
    ks, vs = torch.full((2,), 0.05), torch.full((2,), 0.04)
    k8, v8 = quantize(kc, ks, torch.float8_e4m3fn), quantize(vc, vs, torch.float8_e4m3fn)
    slots = slots[window_start(70, 50):]
    op = load_prefill_attention()
    assert op is not None
    out, _ = op(q, k, v, k8, v8, slots, 0.125, ks, vs, softcap=2.0, window=50)
    kd, vd = dequantize(k8, ks, torch.bfloat16), dequantize(v8, vs, torch.bfloat16)
    ref, _ = prefill_attention_reference(q, k, v, kd, vd, slots, 0.125, softcap=2.0, window=50)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


# --- the torch backend ----------------------------------------------------------------------

def limited_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta_args: tuple, window: int | None, softcap: float | None,
                      scale: float) -> torch.Tensor:
    """Per request, float64: token at p sees slots [p - window + 1, p], scores capped."""
    phase, prefix_lens, extend_lens, table, groups = meta_args
    out, start = [], 0
    for row, (p, n) in enumerate(zip(prefix_lens, extend_lens, strict=True)):
        slots = table[row, : p + n].long()
        keys = k_cache[slots].double().repeat_interleave(G, dim=1)  # (L, Hq, D)
        values = v_cache[slots].double().repeat_interleave(G, dim=1)
        scores = cap_scores(torch.einsum("nhd,lhd->hnl", q[start : start + n].double(), keys)
                            * scale, softcap)
        kpos, qpos = torch.arange(p + n)[None, :], torch.arange(p, p + n)[:, None]
        seen = kpos <= qpos
        if window is not None:
            seen &= kpos > qpos - window
        probs = scores.masked_fill(~seen, float("-inf")).softmax(-1)
        out.append(torch.einsum("hnl,lhd->nhd", probs, values))
        start += n
    return torch.cat(out)


# the torch path is the same code in both dtypes; the native kernels have bf16 paths of their own
@pytest.mark.parametrize(("dtype", "kernel"), [(torch.float32, "torch"),
                                               (torch.float32, "native"),
                                               (torch.bfloat16, "native")])
@pytest.mark.parametrize("case", [c for c in CASES if c != "extend, long chunk in query chunks"])
@pytest.mark.parametrize(("window", "softcap"), [(20, None), (None, 2.5), (7, 2.5)])
def test_backend_window_softcap_matches_reference(case: str, dtype: torch.dtype, kernel: str,
                                                  window: int | None,
                                                  softcap: float | None) -> None:
    """Every path of the backend (shared groups the window may cut, padded cascade, native
    decode and prefill kernels, long chunks in query chunks), and the same forward's plan
    reused by a layer without options (Gemma's global layers) stays exact."""
    phase, prefix_lens, extend_lens, groups = CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    seq = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
    table = make_table(seq, groups, False, gen)
    meta = build_meta(phase, prefix_lens, extend_lens, table, groups)
    T = sum(extend_lens)
    k_cache = torch.randn(NUM_SLOTS, HKV, D, generator=gen).to(dtype)
    v_cache = torch.randn(NUM_SLOTS, HKV, D, generator=gen).to(dtype)
    q = (torch.randn(T, HKV * G + HKV, D, generator=gen) * 3).to(dtype)[:, : HKV * G]
    k = torch.randn(T, HKV, D, generator=gen).to(dtype)
    v = torch.randn(T, HKV, D, generator=gen).to(dtype)
    backend = TorchAttentionBackend()
    if kernel == "native":
        backend = TorchAttentionBackend(load_paged_decode(), load_prefill_attention())
    scale = D**-0.5
    out = backend.forward(q, k, v, k_cache, v_cache, meta, scale, window=window, softcap=softcap)
    args = (phase, prefix_lens, extend_lens, table, groups)
    ref = limited_reference(q, k_cache, v_cache, args, window, softcap, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    full = backend.forward(q, k, v, k_cache, v_cache, meta, scale)  # a global layer
    ref_full = limited_reference(q, k_cache, v_cache, args, None, None, scale)
    torch.testing.assert_close(full.double(), ref_full, rtol=tol, atol=tol)


def test_decode_window_skips_shared_groups() -> None:
    """A window ending inside a group's shared prefix: the group's early keys are out of
    reach, so attending the group once (and merging) would be wrong; the result must equal
    the reference, not the full-context one."""
    phase, prefix_lens, extend_lens, groups = (Phase.DECODE, [70, 75, 90], [1, 1, 1],
                                               [([0, 1, 2], 64)])
    gen = torch.Generator().manual_seed(3)
    table = make_table([71, 76, 91], groups, True, gen)
    meta = build_meta(phase, prefix_lens, extend_lens, table, groups)
    k_cache = torch.randn(NUM_SLOTS, HKV, D, generator=gen)
    v_cache = torch.randn(NUM_SLOTS, HKV, D, generator=gen)
    q = torch.randn(3, HKV * G, D, generator=gen)
    k, v = torch.randn(3, HKV, D, generator=gen), torch.randn(3, HKV, D, generator=gen)
    backend = TorchAttentionBackend(load_paged_decode(), load_prefill_attention())
    out = backend.forward(q, k, v, k_cache, v_cache, meta, 0.2, window=16)
    args = (phase, prefix_lens, extend_lens, table, groups)
    torch.testing.assert_close(out.double(), limited_reference(q, k_cache, v_cache, args, 16,
                                                               None, 0.2), rtol=1e-5, atol=1e-5)
    full = limited_reference(q, k_cache, v_cache, args, None, None, 0.2)
    assert not torch.allclose(out.double(), full, atol=1e-3)


@pytest.mark.parametrize("case", ["decode, two groups + loner", "verify, drafts in a group",
                                  "mixed, decodes + long chunks",
                                  "extend, query chunks after a prefix"])
@pytest.mark.parametrize("kernel", ["torch", "native"])
def test_backend_window_softcap_over_8bit_pool(case: str, kernel: str) -> None:
    """An 8-bit pool (e4m3, per-head scales) through every windowed path: equal to the
    reference over the dequantized pool (the new tokens' K/V put on the 8-bit grid first, so
    that the paths reading them as given and those reading them as stored see the same)."""
    fmt = torch.float8_e4m3fn
    phase, prefix_lens, extend_lens, groups = CASES[case]
    gen = torch.Generator().manual_seed(len(case) + 2)
    table = make_table([p + n for p, n in zip(prefix_lens, extend_lens, strict=True)], groups,
                       False, gen)
    meta = build_meta(phase, prefix_lens, extend_lens, table, groups)
    T = sum(extend_lens)
    k_raw = torch.randn(NUM_SLOTS, HKV, D, generator=gen)
    v_raw = torch.randn(NUM_SLOTS, HKV, D, generator=gen)
    ks = scales_from_amax(k_raw.abs().amax(dim=(0, 2)), fmt)
    vs = scales_from_amax(v_raw.abs().amax(dim=(0, 2)), fmt)
    k8, v8 = quantize(k_raw, ks, fmt), quantize(v_raw, vs, fmt)
    q = torch.randn(T, HKV * G, D, generator=gen) * 3

    def on_grid(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return dequantize(quantize(x, scale, fmt), scale, torch.float32)

    k = on_grid(torch.randn(T, HKV, D, generator=gen), ks)
    v = on_grid(torch.randn(T, HKV, D, generator=gen), vs)
    backend = TorchAttentionBackend()
    if kernel == "native":
        backend = TorchAttentionBackend(load_paged_decode(), load_prefill_attention())
    out = backend.forward(q, k, v, k8, v8, meta, D**-0.5, KVScale(ks, vs), window=20,
                          softcap=2.5)
    k_full, v_full = dequantize(k8, ks, torch.float32), dequantize(v8, vs, torch.float32)
    ref = limited_reference(q, k_full, v_full, (phase, prefix_lens, extend_lens, table, groups),
                            20, 2.5, D**-0.5)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
