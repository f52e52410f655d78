"""The paged attention kernels' shared inner step: a K/V block read, one online-softmax update.

Owns: `kv_scales` (an 8-bit pool's per-KV-head scales, folded into the scores and the output),
`load_kv_block`, `soft_cap` and `online_softmax_step`, @triton.jit helpers (inlined into the
kernels that call them). Does not know: which positions a program attends to or how it masks them
(decode: its split of the sequence; extend: causal over the new tokens), nor its output.
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (triton is untyped, and @triton.jit kernel parameters carry no Python types.)

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def kv_scales(qk_scale, k_scale, v_scale, kvh, QUANT: tl.constexpr):
    """(scores' scale, output factor): an 8-bit cache folds K's scale into the scores and V's
    into the output; a cache in the operands' dtype leaves (qk_scale, 1.0)."""
    v_factor = 1.0
    if QUANT:
        qk_scale = qk_scale * tl.load(k_scale + kvh)
        v_factor = tl.load(v_scale + kvh)
    return qk_scale, v_factor


@triton.jit
def load_kv_block(k_cache, v_cache, table_row, offs_n, mask_n, kvh, offs_d, mask_d,
                  dtype: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  UPCAST: tl.constexpr, QUANT: tl.constexpr):
    """K and V tiles (N, D) of KV head `kvh` at the slots table_row[offs_n]."""
    slots = tl.load(table_row + offs_n, mask=mask_n, other=0).to(tl.int64)  # (N,)
    kv_offs = slots[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kvh * HEAD_DIM + offs_d[None, :]
    kv_mask = mask_n[:, None] & mask_d[None, :]
    # Masked so that stale or never-written slots (garbage, NaN) are never read.
    k_tile = tl.load(k_cache + kv_offs, mask=kv_mask, other=0.0)  # (N, D)
    v_tile = tl.load(v_cache + kv_offs, mask=kv_mask, other=0.0)  # (N, D)
    if QUANT:  # 8-bit values are exact in q's dtype (bf16, fp16 or fp32)
        k_tile = k_tile.to(dtype)
        v_tile = v_tile.to(dtype)
    if UPCAST:
        k_tile = k_tile.to(tl.float32)
        v_tile = v_tile.to(tl.float32)
    return k_tile, v_tile


@triton.jit
def soft_cap(s, cap2):
    """Logit soft-capping of base-2 scores: cap2 * tanh(s / cap2), with cap2 = softcap * log2(e)
    (the cap of natural-log scores, in base-2 units). tanh from exp2 of -2|x| (no overflow);
    triton.language has no tanh that the interpreter also runs."""
    x = s / cap2
    e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)
    t = (1.0 - e) / (1.0 + e)
    return cap2 * tl.where(x < 0, -t, t)


@triton.jit
def online_softmax_step(s, v_tile, m_i, l_i, acc, dtype: tl.constexpr,
                        UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Fold one block of base-2 scores s (rows, N), masked to -inf, and its V tile into the
    running max m_i (rows,), sum l_i (rows,) and output acc (rows, D); returns the three.
    A row with nothing visible yet (a sliding window's later tokens over the early blocks)
    keeps m = -inf, l = 0, acc = 0."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # -inf - -inf would be NaN
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])  # (rows, N)
    l_i = l_i * alpha + tl.sum(p, 1)
    # p is rounded to the operands' dtype for the PV product, as on the GPU path.
    p_lo = p.to(dtype)
    if UPCAST:
        p_lo = p_lo.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p_lo, v_tile, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
