"""Paged prefill (extend) attention: a ragged batch of new tokens over a cached prefix.

Owns: the prefill kernel (SGLang's name: extend) and its wrapper. Does not know: pages or the radix tree; a request's
KV (its cached prefix and its new tokens, already stored) is at slot_table[row, 0 : seq_len].

Layout of one program (grid: query blocks x requests x KV heads): its rows are BLOCK_M new
tokens x the GROUP query heads of one KV head, row r = token r // G_PAD, head r % G_PAD, so
each KV tile is read once per GQA group. New token j of request b sits at absolute position
p = prefix_len + j and attends to KV positions 0..p; the program streams KV blocks from 0 to
the last position any of its tokens needs, with one online softmax (base 2, fp32) over the
cached prefix and the causal part alike. A sliding window W (compile-time: one per layer kind)
bounds each token's keys below by p - W + 1 and starts the stream at the block holding its
first token's bound; a soft-cap caps the scaled scores before the mask.
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
    cdiv,
    check_index,
    check_launchable,
    check_out,
    check_paged_operands,
    dot_flags,
    next_pow2,
)
from triton_kernels._paged_tiles import kv_scales, load_kv_block, online_softmax_step, soft_cap

LOG2E = 1.4426950408889634


@triton.jit
def _extend_kernel(
    q, k_cache, v_cache, slot_table, rows, prefix_lens, extend_lens, cu_extend, out,
    k_scale, v_scale,
    qk_scale, softcap2, stride_qt, stride_qh, stride_ot, stride_oh, stride_table,
    NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, QUANT: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
):
    # BLOCK_R == BLOCK_M * G_PAD
    m_start = tl.program_id(0) * BLOCK_M
    b = tl.program_id(1)
    kvh = tl.program_id(2)
    ext_len = tl.load(extend_lens + b).to(tl.int32)
    prefix = tl.load(prefix_lens + b).to(tl.int32)
    q_start = tl.load(cu_extend + b).to(tl.int64)
    row = tl.load(rows + b).to(tl.int64)

    offs_r = tl.arange(0, BLOCK_R)
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < HEAD_DIM
    tok = m_start + offs_r // G_PAD  # (R,) index among this request's new tokens
    g = offs_r % G_PAD
    mask_r = (tok < ext_len) & (g < GROUP)
    heads = kvh * GROUP + g  # (R,)
    io_mask = mask_r[:, None] & mask_d[None, :]
    q_ptrs = q + (q_start + tok)[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :]
    q_tile = tl.load(q_ptrs, mask=io_mask, other=0.0)  # (R, D)
    if UPCAST:
        q_tile = q_tile.to(tl.float32)
    q_pos = prefix + tok  # (R,) absolute positions; rows past ext_len are masked at the store

    qk_scale, v_factor = kv_scales(qk_scale, k_scale, v_scale, kvh, QUANT)
    dtype = q.dtype.element_ty

    # Blocks past this request's new tokens (a shorter request in the batch) loop zero times.
    last_tok = tl.minimum(m_start + BLOCK_M, ext_len)
    kv_end = tl.where(m_start < ext_len, prefix + last_tok, 0)
    m_i = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    table_row = slot_table + row * stride_table
    kv_start = 0
    if WINDOW > 0:  # the block holding the first token's first visible key
        kv_start = tl.maximum(prefix + m_start - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
    for n0 in range(kv_start, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        k_tile, v_tile = load_kv_block(k_cache, v_cache, table_row, offs_n, mask_n, kvh,
                                       offs_d, mask_d, dtype, NUM_KV_HEADS, HEAD_DIM, UPCAST,
                                       QUANT)  # (N, D) each
        s = tl.dot(q_tile, tl.trans(k_tile), input_precision=DOT_PRECISION) * qk_scale  # (R, N)
        if SOFTCAP:
            s = soft_cap(s, softcap2)
        # Without a window column 0 is visible to every row; with one, a row may see nothing
        # of a block (online_softmax_step keeps such a row empty).
        visible = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]
        if WINDOW > 0:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - WINDOW)
        s = tl.where(visible, s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(s, v_tile, m_i, l_i, acc, dtype, UPCAST,
                                            DOT_PRECISION)

    o = acc * (v_factor / tl.where(l_i > 0, l_i, 1.0))[:, None]  # (R, D)
    out_ptrs = (out + (q_start + tok)[:, None] * stride_ot + heads[:, None] * stride_oh
                + offs_d[None, :])
    tl.store(out_ptrs, o.to(out.dtype.element_ty), mask=io_mask)


class ExtendConfig(NamedTuple):
    block_r: int  # rows (tokens x group heads) per program
    block_n: int  # KV positions per inner step
    num_warps: int
    num_stages: int


def extend_config(device: torch.device, dtype: torch.dtype) -> ExtendConfig:
    if device.type != "cuda":
        return ExtendConfig(64, 64, 4, 1)  # the interpreter: fewer, larger steps
    # Picked so that ptxas reports no register spills for sm_90 at head_dim 128.
    if dtype == torch.float32:
        return ExtendConfig(32, 32, 4, 2)  # fp32 "ieee" dots run on FMA units, in registers
    return ExtendConfig(128, 64, 8, 3)


def extend_attention(
    q: torch.Tensor,  # (T, q_heads, head_dim), T = sum(extend_lens)
    k_cache: torch.Tensor,  # (num_slots, kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_slots, kv_heads, head_dim)
    slot_table: torch.Tensor,  # (max_reqs, max_model_len) int32
    rows: torch.Tensor,  # (B,) table row of each request
    prefix_lens: torch.Tensor,  # (B,) tokens with KV before this forward
    extend_lens: torch.Tensor,  # (B,) new tokens, each >= 1
    cu_extend: torch.Tensor,  # (B + 1,) offsets of each request's tokens in q
    max_extend_len: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,  # (T, q_heads, head_dim)
    k_scale: torch.Tensor | None = None,  # (kv_heads,) float32: an 8-bit cache's scales
    v_scale: torch.Tensor | None = None,
    window: int | None = None,  # sliding window: positions p - window + 1 .. p only
    softcap: float | None = None,  # scores s -> softcap * tanh(s / softcap)
) -> torch.Tensor:  # (T, q_heads, head_dim)
    """Causal attention of each request's new tokens over slot_table[row, 0 : prefix + j + 1]
    (an 8-bit cache: K/V read as stored * k_scale / v_scale of their KV head); with a window,
    over slot_table[row, max(0, p - window + 1) : p + 1] for the token at p = prefix + j; a
    soft-cap applied to the scaled scores.

    The new tokens' K/V must already be stored at their slots. `max_extend_len` (a host int,
    no device sync) must be >= every extend_lens[b]; it only sizes the grid.
    """
    num_tokens, batch = q.shape[0], rows.shape[0]
    num_q_heads, num_kv_heads, head_dim, quant = check_paged_operands(
        q, k_cache, v_cache, k_scale, v_scale, slot_table, rows, batch)
    check_index("prefix_lens", prefix_lens, batch, q.device)
    check_index("extend_lens", extend_lens, batch, q.device)
    check_index("cu_extend", cu_extend, batch + 1, q.device)
    assert 0 <= max_extend_len <= max(num_tokens, 0), f"max_extend_len {max_extend_len}"
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    check_out(out, (num_tokens, num_q_heads, head_dim), q)
    if batch == 0 or num_tokens == 0:
        return out
    check_launchable(_extend_kernel, q.device)
    group = num_q_heads // num_kv_heads
    g_pad = next_pow2(group)
    cfg = extend_config(q.device, q.dtype)
    block_r = max(cfg.block_r, g_pad)
    precision, upcast = dot_flags(q.device, q.dtype)
    grid = (cdiv(max_extend_len, block_r // g_pad), batch, num_kv_heads)
    _extend_kernel[grid](
        q, k_cache, v_cache, slot_table, rows, prefix_lens, extend_lens, cu_extend, out,
        k_scale if quant else out, v_scale if quant else out, scale * LOG2E,
        (softcap or 1.0) * LOG2E, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        slot_table.stride(0),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, G_PAD=g_pad, HEAD_DIM=head_dim,
        BLOCK_R=block_r, BLOCK_D=block_d(head_dim), BLOCK_M=block_r // g_pad,
        BLOCK_N=cfg.block_n,
        DOT_PRECISION=precision, UPCAST=upcast, QUANT=quant, WINDOW=window or 0,
        SOFTCAP=softcap is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out
