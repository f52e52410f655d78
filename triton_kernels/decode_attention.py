"""Paged decode attention: one query token per request over its cached KV, split-K.

Owns: the two decode kernels and their wrapper. Does not know: pages or the radix tree; a
request's KV is wherever `slot_table[row, 0 : seq_len]` points.

Two stages, so that long contexts with small batches still fill the GPU:
  1. grid (B, kv_heads, num_splits): each program takes every query head of one KV head (the
     GQA group, so each KV tile is read once per group) over one contiguous chunk of the
     sequence, and writes a partial result normalised by its own softmax sum, plus that
     chunk's log-sum-exp (base 2).
  2. grid (B, q_heads): merges the chunks by their log-sum-exp.
Chunks are sized per request in the kernel (seq_len / num_splits rounded up to BLOCK_N), so a
short sequence uses fewer chunks; empty chunks report lse = -inf and are skipped by the merge.
A sliding window W (a compile-time constant: one per layer kind) starts each request's range
at seq_len - W, so the splits share only the window's keys; a soft-cap caps the scores.
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (triton is untyped, and @triton.jit kernel parameters carry no Python types.)

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from triton_kernels._common import (
    block_d,
    check_index,
    check_launchable,
    check_out,
    check_paged_operands,
    dot_flags,
    next_pow2,
)
from triton_kernels._paged_tiles import kv_scales, load_kv_block, online_softmax_step, soft_cap

LOG2E = 1.4426950408889634
MAX_SPLITS = 16


# NOTE: the split count is a runtime argument, never specialized: it follows the batch size,
# and a constexpr would compile one variant per batch size an eager server meets (up to
# MAX_SPLITS of them, each a compile while serving). The buffers' split stride is MAX_SPLITS.
@triton.jit(do_not_specialize=["num_splits"])
def _decode_split_kernel(
    q, k_cache, v_cache, slot_table, rows, seq_lens, mid_o, mid_lse, k_scale, v_scale,
    qk_scale, softcap2, stride_qb, stride_qh, stride_table, num_splits,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    QUANT: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    row = tl.load(rows + b).to(tl.int64)
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    lo = 0
    if WINDOW > 0:
        lo = tl.maximum(seq_len - WINDOW, 0)
    split_len = tl.cdiv(tl.cdiv(seq_len - lo, num_splits), BLOCK_N) * BLOCK_N
    start = lo + split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g = offs_g < GROUP
    mask_d = offs_d < HEAD_DIM
    heads = kvh * GROUP + offs_g  # (BLOCK_G,): the query heads that share this KV head
    q_ptrs = q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    q_tile = tl.load(q_ptrs, mask=mask_g[:, None] & mask_d[None, :], other=0.0)  # (G, D)
    if UPCAST:
        q_tile = q_tile.to(tl.float32)

    qk_scale, v_factor = kv_scales(qk_scale, k_scale, v_scale, kvh, QUANT)
    dtype = q.dtype.element_ty
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table_row = slot_table + row * stride_table
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        k_tile, v_tile = load_kv_block(k_cache, v_cache, table_row, offs_n, mask_n, kvh,
                                       offs_d, mask_d, dtype, NUM_KV_HEADS, HEAD_DIM, UPCAST,
                                       QUANT)  # (N, D) each
        s = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION) * qk_scale  # (G, N)
        if SOFTCAP:
            s = soft_cap(s, softcap2)
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v_tile, m_i, l_i, acc, dtype, UPCAST,
                                            DOT_PRECISION)

    # An empty chunk (start >= seq_len) leaves m_i = -inf, l_i = 0: lse = -inf, o = 0.
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    lse = m_i + tl.log2(l_safe)  # (G,)
    o = acc * (v_factor / l_safe)[:, None]  # (G, D)
    # mid_o is (B, q_heads, NUM_SPLITS, HEAD_DIM), mid_lse (B, q_heads, NUM_SPLITS), contiguous.
    mid_idx = (b.to(tl.int64) * (NUM_KV_HEADS * GROUP) + heads) * NUM_SPLITS + split  # (G,)
    tl.store(mid_lse + mid_idx, lse, mask=mask_g)
    tl.store(mid_o + mid_idx[:, None] * HEAD_DIM + offs_d[None, :], o,
             mask=mask_g[:, None] & mask_d[None, :])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_merge_kernel(
    mid_o, mid_lse, seq_lens, out, stride_ob, stride_oh, num_splits,
    NUM_Q_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens + b).to(tl.int32)
    if WINDOW > 0:  # the split kernel's range: the window's keys
        seq_len = tl.minimum(seq_len, WINDOW)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    valid = (offs_s < num_splits) & (offs_s * split_len < seq_len)  # chunk 0 always valid
    base = (b.to(tl.int64) * NUM_Q_HEADS + h) * NUM_SPLITS
    lse = tl.load(mid_lse + base + offs_s, mask=valid, other=float("-inf"))  # (S,)
    o = tl.load(mid_o + (base + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                mask=valid[:, None] & mask_d[None, :], other=0.0)  # (S, D)
    w = tl.exp2(lse - tl.max(lse, 0))  # (S,); 0 for empty chunks
    merged = tl.sum(w[:, None] * o, 0) / tl.sum(w, 0)  # (D,)
    out_ptrs = out + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d
    tl.store(out_ptrs, merged.to(out.dtype.element_ty), mask=mask_d)


class DecodeConfig(NamedTuple):
    block_n: int  # KV positions per inner step; also rounds the chunk length
    num_warps: int


def decode_config(device: torch.device, dtype: torch.dtype) -> DecodeConfig:
    # Picked so that ptxas reports no register spills for sm_90 at head_dim 128: the gathered
    # K/V tiles need a 64-bit address per element, which is what fills the registers.
    if device.type != "cuda":
        return DecodeConfig(64, 4)
    if dtype == torch.float32:
        return DecodeConfig(32, 8)
    return DecodeConfig(64, 8)


def num_sms(device: torch.device) -> int | None:
    """The device's SM count (None off CUDA). Callers on a hot path keep it: the query
    costs host time per call."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def splits_for(batch_size: int, num_kv_heads: int, sms: int | None) -> int:
    """Enough stage-1 programs for ~4 per SM; depends only on shapes (CUDA-graph safe)."""
    if sms is None:
        return 4
    return max(1, min(MAX_SPLITS, -(-4 * sms // (batch_size * num_kv_heads))))


def default_num_splits(batch_size: int, num_kv_heads: int, device: torch.device) -> int:
    return splits_for(batch_size, num_kv_heads, num_sms(device))


def decode_attention(
    q: torch.Tensor,  # (B, q_heads, head_dim)
    k_cache: torch.Tensor,  # (num_slots, kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_slots, kv_heads, head_dim)
    slot_table: torch.Tensor,  # (max_reqs, max_model_len) int32
    rows: torch.Tensor,  # (B,) table row of each request
    seq_lens: torch.Tensor,  # (B,) tokens to attend to, each >= 1
    scale: float,
    *,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,  # (B, q_heads, head_dim)
    k_scale: torch.Tensor | None = None,  # (kv_heads,) float32: an 8-bit cache's scales
    v_scale: torch.Tensor | None = None,
    window: int | None = None,  # sliding window: the last `window` positions only
    softcap: float | None = None,  # scores s -> softcap * tanh(s / softcap)
    check: bool = True,
) -> torch.Tensor:  # (B, q_heads, head_dim)
    """out[b, h] = softmax(q[b, h] . K_b^T * scale) V_b over K_b = k_cache[slot_table[rows[b],
    lo:seq_lens[b]], h // group] with lo = max(0, seq_lens[b] - window) (0 without a window),
    an 8-bit cache times k_scale / v_scale of the KV head, a soft-cap applied to the scaled
    scores. Accumulates in fp32; the current token's K/V must be stored. window and softcap
    are per-layer constants (window compiles into the kernel: CUDA-graph safe).
    `check=False`: skip the operand checks (a caller that checked the same shapes, dtypes and
    devices already: the model's later layers)."""
    batch = q.shape[0]
    if check:
        num_q_heads, num_kv_heads, head_dim, quant = check_paged_operands(
            q, k_cache, v_cache, k_scale, v_scale, slot_table, rows, batch)
        check_index("seq_lens", seq_lens, batch, q.device)
    else:
        num_q_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads, quant = k_cache.shape[1], k_scale is not None
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    if check:
        check_out(out, (batch, num_q_heads, head_dim), q)
    if batch == 0:
        return out
    if check:
        check_launchable(_decode_split_kernel, q.device)
    splits = num_splits or default_num_splits(batch, num_kv_heads, q.device)
    assert 1 <= splits <= MAX_SPLITS, f"num_splits {splits} out of [1, {MAX_SPLITS}]"
    group = num_q_heads // num_kv_heads
    # (B, q_heads, MAX_SPLITS, ...): the split stride is fixed, so is the compiled kernel.
    mid_o = torch.empty((batch, num_q_heads, MAX_SPLITS, head_dim), dtype=torch.float32,
                        device=q.device)
    mid_lse = torch.empty((batch, num_q_heads, MAX_SPLITS), dtype=torch.float32,
                          device=q.device)
    precision, upcast = dot_flags(q.device, q.dtype)
    cfg = decode_config(q.device, q.dtype)
    bd = block_d(head_dim)
    _decode_split_kernel[(batch, num_kv_heads, splits)](
        q, k_cache, v_cache, slot_table, rows, seq_lens, mid_o, mid_lse,
        k_scale if quant else mid_lse, v_scale if quant else mid_lse,
        scale * LOG2E, (softcap or 1.0) * LOG2E, q.stride(0), q.stride(1), slot_table.stride(0),
        splits, NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=MAX_SPLITS,
        BLOCK_G=max(16, next_pow2(group)), BLOCK_D=bd, BLOCK_N=cfg.block_n,
        DOT_PRECISION=precision, UPCAST=upcast, QUANT=quant, WINDOW=window or 0,
        SOFTCAP=softcap is not None, num_warps=cfg.num_warps, num_stages=2,
    )
    _decode_merge_kernel[(batch, num_q_heads)](
        mid_o, mid_lse, seq_lens, out, out.stride(0), out.stride(1), splits,
        NUM_Q_HEADS=num_q_heads, HEAD_DIM=head_dim, NUM_SPLITS=MAX_SPLITS,
        BLOCK_S=MAX_SPLITS, BLOCK_D=bd, BLOCK_N=cfg.block_n, WINDOW=window or 0,
        num_warps=4 if head_dim >= 128 else 2,
    )
    return out
