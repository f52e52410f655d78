"""The Triton kernels over an 8-bit KV cache (--kv-cache-dtype fp8_e4m3 / fp8_e5m2) against the
torch reference that dequantizes (stored * scale of the KV head).

Same set-up as test_kernels.py (CUDA when present, else Triton's interpreter; slots no request
owns hold NaN codes, outputs start NaN): the store must write exactly the reference's bytes,
and attention over those bytes must match the reference's attention over the same bytes.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_kernels.test_fused_kernels import rope_inputs
from tests.triton_kernels.test_kernels import (
    DEVICE,
    Paged,
    make_paged,
    randn,
    rel_err,
    runnable_kernels,  # noqa: F401  (the fixture, used by name)
)
from triton_kernels import decode_attention, extend_attention, store_kv
from triton_kernels.reference import (
    decode_attention_ref,
    extend_attention_ref,
    rope_qk_store_ref,
    store_kv_ref,
)
from triton_kernels.rope import rope_qk_store

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
F32, BF16 = torch.float32, torch.bfloat16
TOL = {F32: 1e-5, BF16: 1e-2}


def fp8_cache(paged: Paged, kv_heads: int, head_dim: int, fmt: torch.dtype,
              gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                              torch.Tensor]:
    """(k_cache, v_cache, k_scale, v_scale): owned slots hold quantized random K/V (per-head
    spreads differ, so a wrong head's scale shows), the others NaN codes."""
    shape = (paged.num_slots, kv_heads, head_dim)
    caches = [torch.full(shape, float("nan"), device=DEVICE).to(fmt) for _ in range(2)]
    spread = torch.linspace(0.5, 4.0, kv_heads, device=DEVICE)
    n = paged.used_slots.shape[0]
    scales = []
    for cache in caches:
        x = randn((n, kv_heads, head_dim), F32, gen) * spread[None, :, None]
        s = (x.abs().amax(dim=(0, 2)) / torch.finfo(fmt).max).float()
        cache.view(torch.uint8)[paged.used_slots] = (x / s[None, :, None]).to(fmt).view(
            torch.uint8)
        scales.append(s)
    return caches[0], caches[1], scales[0], scales[1]


@pytest.mark.usefixtures("runnable_kernels")
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_store_kv_fp8_writes_the_reference_bytes(fmt: torch.dtype, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    num_tokens, kv_heads, head_dim = 37, 3, 64
    paged = make_paged([num_tokens], 16, gen)
    shape = (paged.num_slots, kv_heads, head_dim)
    fused = randn((num_tokens, 3 * kv_heads, head_dim), dtype, gen) * 8
    k, v = fused[:, kv_heads : 2 * kv_heads], fused[:, 2 * kv_heads :]
    # Head 0's scales are too small for its values: they saturate (clamped, not inf or NaN).
    fit = torch.tensor([0.5, 1.0, 3.0], device=DEVICE) / torch.finfo(fmt).max
    k_scale = (k.float().abs().amax(dim=(0, 2)) * fit).contiguous()
    v_scale = (v.float().abs().amax(dim=(0, 2)) * fit.flip(0)).contiguous()
    out = [torch.full(shape, float("nan"), device=DEVICE).to(fmt) for _ in range(4)]
    store_kv(out[0], out[1], k, v, paged.used_slots, k_scale, v_scale)
    store_kv_ref(out[2], out[3], k, v, paged.used_slots, k_scale, v_scale)
    assert torch.equal(out[0].view(torch.uint8), out[2].view(torch.uint8))
    assert torch.equal(out[1].view(torch.uint8), out[3].view(torch.uint8))
    stored = out[0][paged.used_slots].float()
    assert torch.isfinite(stored).all() and stored.abs().max() == torch.finfo(fmt).max


@pytest.mark.usefixtures("runnable_kernels")
@pytest.mark.parametrize("fmt", [E4M3, E5M2])
@pytest.mark.parametrize(("tokens", "q_heads", "kv_heads", "head_dim", "dtype"),
                         [(7, 9, 3, 64, BF16), (5, 4, 2, 128, F32), (3, 8, 2, 64, F32)])
def test_rope_qk_store_fp8_writes_the_reference_bytes(tokens: int, q_heads: int, kv_heads: int,
                                                      head_dim: int, dtype: torch.dtype,
                                                      fmt: torch.dtype) -> None:
    """The fused RoPE + store into an 8-bit pool: the bytes of RoPE then store_kv (the rotated k
    rounded to the model's dtype, then x / scale on the 8-bit grid), q rotated as without it."""
    qkv, table, positions = rope_inputs(tokens, q_heads, kv_heads, head_dim, dtype)
    qkv.mul_(8)
    num_slots = 2 * tokens + 3
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(1))[:tokens]
    slots = slots.to(DEVICE)
    k = qkv[:, q_heads * head_dim : (q_heads + kv_heads) * head_dim].view(tokens, kv_heads, -1)
    v = qkv[:, (q_heads + kv_heads) * head_dim :].view(tokens, kv_heads, -1)
    # Head 0's scales are too small for its values: they saturate (clamped, not inf or NaN).
    fit = torch.linspace(0.3, 2.0, kv_heads, device=DEVICE) / torch.finfo(fmt).max
    k_scale = (k.float().abs().amax(dim=(0, 2)) * fit).contiguous()
    v_scale = (v.float().abs().amax(dim=(0, 2)) * fit.flip(0)).contiguous()
    shape = (num_slots, kv_heads, head_dim)
    out = [torch.full(shape, float("nan"), device=DEVICE).to(fmt) for _ in range(4)]
    ref = qkv.clone()
    rope_qk_store(qkv, table.cos, table.sin, positions, q_heads, out[0], out[1], slots,
                  k_scale, v_scale)
    rope_qk_store_ref(ref, table.cos, table.sin, positions, q_heads, kv_heads,
                      (out[2], out[3]), slots, k_scale, v_scale)
    assert torch.equal(qkv, ref), "q rotated in place, k and v columns left as they were"
    for got, want in ((out[0], out[2]), (out[1], out[3])):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        stored = got[slots].float()
        assert torch.isfinite(stored).all() and stored.abs().max() == torch.finfo(fmt).max


@pytest.mark.usefixtures("runnable_kernels")
def test_store_kv_fp8_needs_its_scales() -> None:
    cache = torch.zeros(8, 2, 64, device=DEVICE).to(E4M3)
    k = torch.zeros(2, 2, 64, device=DEVICE)
    with pytest.raises(AssertionError, match="k_scale and v_scale"):
        store_kv(cache, cache.clone(), k, k, torch.tensor([1, 2], device=DEVICE))


DECODE_LENS = [1, 15, 64, 65, 129, 300]


@pytest.mark.usefixtures("runnable_kernels")
@pytest.mark.parametrize(("fmt", "dtype", "group", "num_splits"),
                         [(E4M3, BF16, 3, None), (E5M2, F32, 2, 3), (E4M3, F32, 1, 1)])
def test_decode_attention_fp8_matches_dequantizing_reference(
        fmt: torch.dtype, dtype: torch.dtype, group: int, num_splits: int | None) -> None:
    gen = torch.Generator().manual_seed(11)
    kv_heads, head_dim = 3, 64
    paged = make_paged(DECODE_LENS, 16, gen)
    k_cache, v_cache, ks, vs = fp8_cache(paged, kv_heads, head_dim, fmt, gen)
    q = randn((len(DECODE_LENS), kv_heads * group, head_dim), dtype, gen)
    seq_lens = torch.tensor(DECODE_LENS, dtype=torch.int32, device=DEVICE)
    out = torch.full_like(q, float("nan"))
    decode_attention(q, k_cache, v_cache, paged.slot_table, paged.rows, seq_lens, 0.125,
                     num_splits=num_splits, out=out, k_scale=ks, v_scale=vs)
    ref = decode_attention_ref(q.float(), k_cache, v_cache, paged.slot_table, paged.rows,
                               seq_lens, 0.125, ks, vs)
    assert rel_err(out, ref) <= TOL[dtype]


@pytest.mark.usefixtures("runnable_kernels")
@pytest.mark.parametrize(("fmt", "dtype"), [(E4M3, F32), (E5M2, BF16)])
def test_extend_attention_fp8_matches_dequantizing_reference(fmt: torch.dtype,
                                                             dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(13)
    reqs, kv_heads, group, head_dim = [(0, 37), (16, 1), (64, 65), (5, 16)], 2, 3, 64
    paged = make_paged([p + n for p, n in reqs], 16, gen)
    k_cache, v_cache, ks, vs = fp8_cache(paged, kv_heads, head_dim, fmt, gen)
    prefix_lens = torch.tensor([p for p, _ in reqs], dtype=torch.int32, device=DEVICE)
    extend_lens = torch.tensor([n for _, n in reqs], dtype=torch.int32, device=DEVICE)
    cu = torch.zeros(len(reqs) + 1, dtype=torch.int32, device=DEVICE)
    cu[1:] = extend_lens.cumsum(0)
    q = randn((int(extend_lens.sum()), kv_heads * group, head_dim), dtype, gen)
    out = torch.full_like(q, float("nan"))
    table, rows = paged.slot_table, paged.rows
    extend_attention(q, k_cache, v_cache, table, rows, prefix_lens, extend_lens, cu,
                     max(n for _, n in reqs), 0.125, out=out, k_scale=ks, v_scale=vs)
    ref = extend_attention_ref(q.float(), k_cache, v_cache, table, rows, prefix_lens,
                               extend_lens, cu, 0.125, ks, vs)
    assert rel_err(out, ref) <= TOL[dtype]
