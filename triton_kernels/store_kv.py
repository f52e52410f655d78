"""Scatter this forward's new K/V rows into the paged KV pool.

Owns: the store kernel and its wrapper, and the 8-bit store rule the fused RoPE + store kernel
(rope.py) shares: an 8-bit cache stores x / scale of its KV head, saturated to the format's
range, rounded to nearest even as torch's cast does (`quantize_kv`, `fp8_launch_args`).
Does not know: pages, requests or the radix tree; a slot is just a row index of the
(num_slots, kv_heads, head_dim) caches.
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (triton is untyped, and @triton.jit kernel parameters carry no Python types.)

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_kernels._common import (
    check_heads_last_contiguous,
    check_index,
    check_kv_cache,
    check_kv_scales,
    check_launchable,
    next_pow2,
)


@triton.jit
def _round_to_grid(y, MAN_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    # y (fp32, in the format's range) rounded to nearest even on the 8-bit format's grid: its
    # spacing is 2^(exponent - MAN_BITS), at least 2^(MIN_EXP - MAN_BITS) (the subnormals).
    # Exact fp32 arithmetic: the exponent read from the bits, the rounding by adding and
    # removing 1.5 * 2^23 (|y / spacing| < 2^(MAN_BITS + 1)).
    exp = ((y.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    exp = tl.maximum(exp, MIN_EXP) - MAN_BITS
    spacing = ((exp + 127) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23
    return ((y / spacing + magic) - magic) * spacing


@triton.jit
def quantize_kv(x, scale, FP8_MAX: tl.constexpr, PRE_ROUND: tl.constexpr,
                MAN_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """x (heads, dim) / scale (heads, 1) in fp32, saturated, on the 8-bit grid (rounded to
    nearest even: by hand under the interpreter, whose fp32 -> fp8 cast drops the rounding
    carry; the caller's cast to the cache dtype rounds on a GPU)."""
    y = tl.clamp(x.to(tl.float32) / scale, -FP8_MAX, FP8_MAX)
    if PRE_ROUND:
        y = _round_to_grid(y, MAN_BITS, MIN_EXP)
    return y


def fp8_launch_args(cache: torch.Tensor, quant: bool) -> dict[str, object]:
    """quantize_kv's constexprs for a cache of this dtype (placeholders when not quant)."""
    e4m3 = cache.dtype == torch.float8_e4m3fn
    return {"QUANT": quant, "FP8_MAX": float(torch.finfo(cache.dtype).max) if quant else 0.0,
            "PRE_ROUND": quant and cache.device.type == "cpu", "MAN_BITS": 3 if e4m3 else 2,
            "MIN_EXP": -6 if e4m3 else -14}


@triton.jit
def _store_kv_kernel(
    k_cache, v_cache, k, v, slots, k_scale, v_scale,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr,
    PRE_ROUND: tl.constexpr, MAN_BITS: tl.constexpr, MIN_EXP: tl.constexpr,
):
    # One program per token: its (heads, head_dim) tile moves as one block.
    t = tl.program_id(0)
    slot = tl.load(slots + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)
    k_tile = tl.load(k + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v_tile = tl.load(v + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if QUANT:  # x / scale of its head, saturated, rounded to the 8-bit format
        ks = tl.load(k_scale + offs_h, mask=offs_h < NUM_HEADS, other=1.0)  # (H,)
        vs = tl.load(v_scale + offs_h, mask=offs_h < NUM_HEADS, other=1.0)
        k_tile = quantize_kv(k_tile, ks[:, None], FP8_MAX, PRE_ROUND, MAN_BITS, MIN_EXP)
        v_tile = quantize_kv(v_tile, vs[:, None], FP8_MAX, PRE_ROUND, MAN_BITS, MIN_EXP)
        k_tile = k_tile.to(k_cache.dtype.element_ty)
        v_tile = v_tile.to(v_cache.dtype.element_ty)
    # The caches are contiguous: slot-major, then head, then head_dim.
    dst = slot * (NUM_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(k_cache + dst, k_tile, mask=mask)
    tl.store(v_cache + dst, v_tile, mask=mask)


def store_kv(
    k_cache: torch.Tensor,  # (num_slots, kv_heads, head_dim), written in place
    v_cache: torch.Tensor,  # (num_slots, kv_heads, head_dim), written in place
    k: torch.Tensor,  # (T, kv_heads, head_dim)
    v: torch.Tensor,  # (T, kv_heads, head_dim)
    slots: torch.Tensor,  # (T,) int32/int64, distinct, each in [0, num_slots)
    k_scale: torch.Tensor | None = None,  # (kv_heads,) float32: an 8-bit cache's scales
    v_scale: torch.Tensor | None = None,
) -> None:
    """k_cache[slots] = k; v_cache[slots] = v (an 8-bit cache: k / k_scale[h], saturated).

    Slots are not range-checked on the device (that would need a sync): the caller owns them.
    """
    check_kv_cache(k_cache, v_cache)
    _, num_heads, head_dim = k_cache.shape
    num_tokens = k.shape[0]
    check_heads_last_contiguous("k", k, num_heads, head_dim)
    check_heads_last_contiguous("v", v, num_heads, head_dim)
    assert v.shape[0] == num_tokens, f"k has {num_tokens} tokens, v has {v.shape[0]}"
    assert k.dtype == v.dtype, f"k/v dtypes {k.dtype}/{v.dtype} differ"
    quant = check_kv_scales(k_cache, k_scale, v_scale, k.dtype)
    assert k.device == k_cache.device and v.device == k_cache.device
    check_index("slots", slots, num_tokens, k_cache.device)
    if num_tokens == 0:
        return
    check_launchable(_store_kv_kernel, k_cache.device)
    _store_kv_kernel[(num_tokens,)](
        k_cache, v_cache, k, v, slots, k_scale if quant else k, v_scale if quant else v,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=next_pow2(num_heads), BLOCK_D=next_pow2(head_dim),
        **fp8_launch_args(k_cache, quant),
    )
