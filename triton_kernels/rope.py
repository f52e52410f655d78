"""Rotary embeddings on q and k of a fused qkv projection, optionally with the KV store.

Owns: the RoPE kernel and its two wrappers: `rope_qk` rotates the q and k heads of qkv in
place; `rope_qk_store` rotates q in place and writes the rotated k and the untouched v
straight into the paged KV pool's slots (store_kv's job, so one launch replaces RoPE's
several elementwise passes and the store; an 8-bit pool gets x / scale of the KV head on the
8-bit grid, store_kv's rule, from the rotated k rounded to the model's dtype first, as the
unfused RoPE then store gives). Does not know: pages, requests, how the cos/sin tables are
built (radixserve/model/rope.py).

Convention (Llama's rotate-half, as radixserve.model.rope.RotaryTable stores it): cos and sin
are (max_positions, head_dim) tables indexed by each token's position, and `sin`'s first
half is negated, so out = x * cos + roll(x, head_dim / 2) * sin, i.e. HF's
x * cos + rotate_half(x) * sin product for product. Each product rounds to the input dtype
before the sum (as torch's elementwise ops do), with FP contraction off, so the results are
`reference.rope_qk_store_ref`'s bit for bit in fp32 and in bf16 (the tests assert equality;
a bf16 tolerance, if a GPU ever rounded differently, would be one rounding step: 2**-7).

NOTE (host cost): the argument checks cost about as much host time as the launch itself;
`check=False` skips them for a caller that has checked the same layout already
(model/layers/ check layer 0's call of each forward).
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (triton is untyped, and @triton.jit kernel parameters carry no Python types.)

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_kernels._common import (
    KV_DTYPES,
    check_index,
    check_kv_cache,
    check_kv_scales,
    check_launchable,
    next_pow2,
)
from triton_kernels._rounding import round_to
from triton_kernels.store_kv import fp8_launch_args, quantize_kv


@triton.jit
def _rotate(x1, x2, c1, c2, s1, s2, dtype: tl.constexpr):
    """(x1, x2) halves -> rotated halves, each product rounded to `dtype` before the add."""
    o1 = round_to(x1 * c1, dtype).to(tl.float32) + round_to(x2 * s1, dtype).to(tl.float32)
    o2 = round_to(x2 * c2, dtype).to(tl.float32) + round_to(x1 * s2, dtype).to(tl.float32)
    return round_to(o1, dtype), round_to(o2, dtype)


@triton.jit
def _rope_kernel(
    qkv, cos, sin, positions, k_cache, v_cache, slots, k_scale, v_scale, stride_t,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    STORE: tl.constexpr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr, PRE_ROUND: tl.constexpr,
    MAN_BITS: tl.constexpr, MIN_EXP: tl.constexpr,
):
    # One program per token: all its q heads, k heads (and v heads when storing) as tiles.
    HALF: tl.constexpr = HEAD_DIM // 2
    dtype = qkv.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_ok = offs_d < HALF
    c1 = tl.load(cos + pos * HEAD_DIM + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    c2 = tl.load(cos + pos * HEAD_DIM + HALF + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    s1 = tl.load(sin + pos * HEAD_DIM + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    s2 = tl.load(sin + pos * HEAD_DIM + HALF + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    row = qkv + t * stride_t

    # q heads: [0, NUM_Q_HEADS) of the row, rotated in place.
    offs_hq = tl.arange(0, BLOCK_HQ)
    mq = (offs_hq[:, None] < NUM_Q_HEADS) & d_ok[None, :]
    pq = row + offs_hq[:, None] * HEAD_DIM + offs_d[None, :]
    q1 = tl.load(pq, mask=mq, other=0.0).to(tl.float32)
    q2 = tl.load(pq + HALF, mask=mq, other=0.0).to(tl.float32)
    o1, o2 = _rotate(q1, q2, c1[None, :], c2[None, :], s1[None, :], s2[None, :], dtype)
    tl.store(pq, o1, mask=mq)
    tl.store(pq + HALF, o2, mask=mq)

    # k heads follow the q heads, v heads follow the k heads.
    offs_hk = tl.arange(0, BLOCK_HK)
    mk = (offs_hk[:, None] < NUM_KV_HEADS) & d_ok[None, :]
    head_off = offs_hk[:, None] * HEAD_DIM + offs_d[None, :]
    pk = row + NUM_Q_HEADS * HEAD_DIM + head_off
    k1 = tl.load(pk, mask=mk, other=0.0).to(tl.float32)
    k2 = tl.load(pk + HALF, mask=mk, other=0.0).to(tl.float32)
    o1, o2 = _rotate(k1, k2, c1[None, :], c2[None, :], s1[None, :], s2[None, :], dtype)
    if STORE:
        # The pool is contiguous: slot-major, then head, then head_dim.
        slot = tl.load(slots + t).to(tl.int64)
        dst = slot * (NUM_KV_HEADS * HEAD_DIM) + head_off
        pv = pk + NUM_KV_HEADS * HEAD_DIM
        v1 = tl.load(pv, mask=mk, other=0.0)
        v2 = tl.load(pv + HALF, mask=mk, other=0.0)
        if QUANT:  # x / scale of its KV head, saturated, rounded to the 8-bit format
            hk_ok = offs_hk < NUM_KV_HEADS
            ks = tl.load(k_scale + offs_hk, mask=hk_ok, other=1.0)[:, None]  # (BLOCK_HK, 1)
            vs = tl.load(v_scale + offs_hk, mask=hk_ok, other=1.0)[:, None]
            o1 = quantize_kv(o1, ks, FP8_MAX, PRE_ROUND, MAN_BITS, MIN_EXP)
            o2 = quantize_kv(o2, ks, FP8_MAX, PRE_ROUND, MAN_BITS, MIN_EXP)
            v1 = quantize_kv(v1, vs, FP8_MAX, PRE_ROUND, MAN_BITS, MIN_EXP)
            v2 = quantize_kv(v2, vs, FP8_MAX, PRE_ROUND, MAN_BITS, MIN_EXP)
        cache_ty = k_cache.dtype.element_ty
        tl.store(k_cache + dst, o1.to(cache_ty), mask=mk)
        tl.store(k_cache + dst + HALF, o2.to(cache_ty), mask=mk)
        tl.store(v_cache + dst, v1.to(cache_ty), mask=mk)
        tl.store(v_cache + dst + HALF, v2.to(cache_ty), mask=mk)
    else:
        tl.store(pk, o1, mask=mk)
        tl.store(pk + HALF, o2, mask=mk)


def _check_args(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor, num_heads: int) -> int:
    """Checks shared by both wrappers; returns head_dim."""
    assert qkv.dim() == 2, f"qkv must be (tokens, width), got {tuple(qkv.shape)}"
    assert qkv.dtype in KV_DTYPES, f"unsupported dtype {qkv.dtype}"
    assert qkv.stride(1) == 1, f"qkv rows must be contiguous, strides {qkv.stride()}"
    assert cos.dim() == 2 and cos.shape == sin.shape, (
        f"cos/sin must be (max_positions, head_dim) alike, got {cos.shape}, {sin.shape}")
    head_dim = cos.shape[1]
    assert head_dim % 2 == 0, f"head_dim {head_dim} must be even"
    assert qkv.shape[1] >= num_heads * head_dim, (
        f"qkv width {qkv.shape[1]} < {num_heads} heads x {head_dim}")
    assert cos.dtype == qkv.dtype and sin.dtype == qkv.dtype, (
        f"cos/sin dtypes {cos.dtype}/{sin.dtype} differ from qkv's {qkv.dtype}")
    assert cos.is_contiguous() and sin.is_contiguous(), "cos/sin tables must be contiguous"
    assert cos.device == qkv.device and sin.device == qkv.device
    check_index("positions", positions, qkv.shape[0], qkv.device)
    return int(head_dim)


def _check_store_args(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      positions: torch.Tensor, num_q_heads: int, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slots: torch.Tensor, k_scale: torch.Tensor | None,
                      v_scale: torch.Tensor | None) -> None:
    check_kv_cache(k_cache, v_cache)
    _, num_kv_heads, head_dim = k_cache.shape
    assert _check_args(qkv, cos, sin, positions, num_q_heads + 2 * num_kv_heads) == head_dim, (
        f"cos/sin head_dim {cos.shape[1]} != the cache's {head_dim}")
    check_kv_scales(k_cache, k_scale, v_scale, qkv.dtype)
    assert k_cache.device == qkv.device
    check_index("slots", slots, qkv.shape[0], qkv.device)


def _launch(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
            num_q_heads: int, num_kv_heads: int, caches: tuple[torch.Tensor, torch.Tensor] | None,
            slots: torch.Tensor | None,
            scales: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    head_dim = cos.shape[1]
    if qkv.shape[0] == 0:
        return
    check_launchable(_rope_kernel, qkv.device)
    k_cache, v_cache = caches if caches is not None else (qkv, qkv)  # unused without STORE
    k_scale, v_scale = scales if scales is not None else (qkv, qkv)  # unused without QUANT
    _rope_kernel[(qkv.shape[0],)](
        qkv, cos, sin, positions, k_cache, v_cache, slots if slots is not None else positions,
        k_scale, v_scale, qkv.stride(0),
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_HQ=next_pow2(num_q_heads),
        BLOCK_HK=next_pow2(num_kv_heads),
        BLOCK_HALF=next_pow2(head_dim // 2),
        STORE=caches is not None, **fp8_launch_args(k_cache, scales is not None),
        num_warps=4, enable_fp_fusion=False,
    )


def rope_qk(
    qkv: torch.Tensor,  # (T, >= (q_heads + kv_heads) * head_dim), rotated in place
    cos: torch.Tensor,  # (max_positions, head_dim)
    sin: torch.Tensor,  # (max_positions, head_dim), first half negated
    positions: torch.Tensor,  # (T,) int32/int64, each in [0, max_positions)
    num_q_heads: int,
    num_kv_heads: int,
    *,
    check: bool = True,
) -> None:
    """Rotate the first q_heads + kv_heads head_dim-wide column groups of qkv in place.
    `check=False` skips the argument checks (see the module's NOTE)."""
    if check:
        _check_args(qkv, cos, sin, positions, num_q_heads + num_kv_heads)
    _launch(qkv, cos, sin, positions, num_q_heads, num_kv_heads, None, None)


def rope_qk_store(
    qkv: torch.Tensor,  # (T, (q_heads + 2 * kv_heads) * head_dim) or wider
    cos: torch.Tensor,  # (max_positions, head_dim)
    sin: torch.Tensor,  # (max_positions, head_dim), first half negated
    positions: torch.Tensor,  # (T,) int32/int64, each in [0, max_positions)
    num_q_heads: int,
    k_cache: torch.Tensor,  # (num_slots, kv_heads, head_dim), written in place
    v_cache: torch.Tensor,  # (num_slots, kv_heads, head_dim), written in place
    slots: torch.Tensor,  # (T,) int32/int64, distinct, each in [0, num_slots)
    k_scale: torch.Tensor | None = None,  # (kv_heads,) float32: an 8-bit cache's scales
    v_scale: torch.Tensor | None = None,
    *,
    check: bool = True,
) -> None:
    """Rotate q in place; k_cache[slots] = rotated k; v_cache[slots] = v (an 8-bit cache:
    divided by k_scale / v_scale of the head, saturated, rounded to the format, as store_kv).

    qkv's k columns are left unrotated (attention reads k from the pool). Positions and slots
    are not range-checked on the device (that would need a sync): the caller owns them.
    `check=False` skips the argument checks (see the module's NOTE).
    """
    num_kv_heads = k_cache.shape[1]
    if check:
        _check_store_args(qkv, cos, sin, positions, num_q_heads, k_cache, v_cache, slots,
                          k_scale, v_scale)
    scales = (k_scale, v_scale) if k_scale is not None and v_scale is not None else None
    _launch(qkv, cos, sin, positions, num_q_heads, num_kv_heads, (k_cache, v_cache), slots,
            scales)
