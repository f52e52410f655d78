"""LoRA expand: y += t @ B[slot].T for each token's adapter, over stacked adapter weights.

Owns: two kernels and their wrapper, the shrink's partners (lora_shrink.py: SGMV over
segments for prefill, BGMV per token for decode; slot -1 is the base model, left untouched).
The delta is added in fp32 to y's value and rounded to y's dtype once (as torch's
`y.addmm_(t, B.T)` on y's dtype). Does not know: which adapter is in which slot, the model.
Graph capture: as the shrink's (the grid depends on the token count and the number of
segment entries only).
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (triton is untyped, and @triton.jit kernel parameters carry no Python types.)

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_kernels._common import cdiv, check_launchable, check_lora_operands, next_pow2

BLOCK_M = 16
BLOCK_N = 64


@triton.jit
def _sgmv_expand_kernel(t, b, y, seg_start, seg_len, seg_slot, stride_t, stride_bs, stride_bn,
                        stride_y, N, R, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_R: tl.constexpr):
    seg = tl.program_id(0)
    first = tl.program_id(1) * BLOCK_M
    slot = tl.load(seg_slot + seg)
    n = tl.load(seg_len + seg)
    if slot < 0 or first >= n:
        return
    start = tl.load(seg_start + seg).to(tl.int64)
    rows = first + tl.arange(0, BLOCK_M)
    cols = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    row_ok, col_ok, r_ok = rows < n, cols < N, rs < R
    tt = tl.load(t + (start + rows)[:, None] * stride_t + rs[None, :],
                 mask=row_ok[:, None] & r_ok[None, :], other=0.0)  # (BLOCK_M, BLOCK_R) fp32
    bt = tl.load(b + slot.to(tl.int64) * stride_bs + cols[None, :] * stride_bn + rs[:, None],
                 mask=col_ok[None, :] & r_ok[:, None], other=0.0).to(tl.float32)
    delta = tl.dot(tt, bt, input_precision="ieee")  # (BLOCK_M, BLOCK_N)
    ptrs = y + (start + rows)[:, None] * stride_y + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    yv = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (yv + delta).to(y.dtype.element_ty), mask=mask)


@triton.jit
def _bgmv_expand_kernel(t, b, y, token_slot, stride_t, stride_bs, stride_bn, stride_y, N, R,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(token_slot + tok)
    if slot < 0:
        return
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    col_ok, r_ok = cols < N, rs < R
    tv = tl.load(t + tok * stride_t + rs, mask=r_ok, other=0.0)  # (BLOCK_R,) fp32
    bt = tl.load(b + slot.to(tl.int64) * stride_bs + cols[:, None] * stride_bn + rs[None, :],
                 mask=col_ok[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
    delta = tl.sum(bt * tv[None, :], axis=1)  # (BLOCK_N,)
    ptrs = y + tok * stride_y + cols
    yv = tl.load(ptrs, mask=col_ok, other=0.0).to(tl.float32)
    tl.store(ptrs, (yv + delta).to(y.dtype.element_ty), mask=col_ok)


def lora_expand(t: torch.Tensor,  # (T, R) float32, the shrink's output
                b_stack: torch.Tensor,  # (S, N, R): slot s's B (scaling folded in)
                y: torch.Tensor,  # (T, N), added to in place
                seg_start: torch.Tensor,  # (G,) int32
                seg_len: torch.Tensor,  # (G,) int32
                seg_slot: torch.Tensor,  # (G,) int32, -1: the base model
                max_seg_len: int) -> torch.Tensor:
    """SGMV expand over segments (see lora_shrink for `max_seg_len`)."""
    check_lora_operands(t, b_stack, y, fp32=t)
    if y.shape[0] == 0 or max_seg_len == 0:
        return y
    check_launchable(_sgmv_expand_kernel, y.device)
    n, r = y.shape[1], b_stack.shape[2]
    grid = (seg_slot.shape[0], cdiv(max_seg_len, BLOCK_M), cdiv(n, BLOCK_N))
    _sgmv_expand_kernel[grid](
        t, b_stack, y, seg_start, seg_len, seg_slot, t.stride(0), b_stack.stride(0),
        b_stack.stride(1), y.stride(0), n, r, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        BLOCK_R=max(16, next_pow2(r)))
    return y


def lora_expand_tokens(t: torch.Tensor,  # (T, R) float32
                       b_stack: torch.Tensor,  # (S, N, R)
                       y: torch.Tensor,  # (T, N)
                       token_slot: torch.Tensor,  # (T,) int32, -1: base
                       ) -> torch.Tensor:
    """BGMV expand: one program per (token, BLOCK_N columns) (decode)."""
    check_lora_operands(t, b_stack, y, fp32=t, token_slot=token_slot)
    if y.shape[0] == 0:
        return y
    check_launchable(_bgmv_expand_kernel, y.device)
    n, r = y.shape[1], b_stack.shape[2]
    _bgmv_expand_kernel[(y.shape[0], cdiv(n, BLOCK_N))](
        t, b_stack, y, token_slot, t.stride(0), b_stack.stride(0), b_stack.stride(1),
        y.stride(0), n, r, BLOCK_N=BLOCK_N, BLOCK_R=next_pow2(r))
    return y
