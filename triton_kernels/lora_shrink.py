"""LoRA shrink: t = x @ A[slot].T for each token's adapter, over stacked adapter weights.

Owns: two kernels and their wrapper. SGMV (prefill; Punica's segmented gather matrix-vector
product): the batch's tokens come in contiguous segments, one adapter slot each; one program
per (segment, BLOCK_M rows) multiplies its row tile by its slot's A with `tl.dot`. BGMV
(decode: one token per request): one program per token, its row times its slot's A as a
broadcast product and row sum (no 16-row tile wasted on one token). A slot of -1 is the base
model: nothing is written for it (the expand kernel skips it too).
Does not know: which adapter is in which slot (model/lora_delta.py's LoRASlots), the model.

Graph capture: the grid depends only on the token count and the fixed number of segment
entries (`--max-loras` + 1: the base and each adapter), never on the segments' contents,
which are read from device tensors; unused entries have length 0.
Numerics: fp32 accumulation; fp32 operands multiply in IEEE fp32 (no TF32), so the result
equals `reference.lora_shrink_ref` within fp32 summation-order error.
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (triton is untyped, and @triton.jit kernel parameters carry no Python types.)

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_kernels._common import cdiv, check_launchable, check_lora_operands, next_pow2

BLOCK_M = 16
BLOCK_K = 32


@triton.jit
def _sgmv_shrink_kernel(x, a, out, seg_start, seg_len, seg_slot, stride_x, stride_as,
                        stride_ar, stride_o, K, R, BLOCK_M: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    seg = tl.program_id(0)
    first = tl.program_id(1) * BLOCK_M
    slot = tl.load(seg_slot + seg)
    n = tl.load(seg_len + seg)
    if slot < 0 or first >= n:
        return
    start = tl.load(seg_start + seg).to(tl.int64)
    rows = first + tl.arange(0, BLOCK_M)
    rs = tl.arange(0, BLOCK_R)
    row_ok, r_ok = rows < n, rs < R
    base_a = a + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xt = tl.load(x + (start + rows)[:, None] * stride_x + ks[None, :],
                     mask=row_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        at = tl.load(base_a + rs[None, :] * stride_ar + ks[:, None],
                     mask=r_ok[None, :] & k_ok[:, None], other=0.0).to(tl.float32)
        acc += tl.dot(xt, at, input_precision="ieee")  # (BLOCK_M, BLOCK_R)
    tl.store(out + (start + rows)[:, None] * stride_o + rs[None, :], acc,
             mask=row_ok[:, None] & r_ok[None, :])


@triton.jit
def _bgmv_shrink_kernel(x, a, out, token_slot, stride_x, stride_as, stride_ar, stride_o, K, R,
                        BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(token_slot + tok)
    if slot < 0:
        return
    rs = tl.arange(0, BLOCK_R)
    r_ok = rs < R
    base_a = a + slot.to(tl.int64) * stride_as
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        xv = tl.load(x + tok * stride_x + ks, mask=k_ok, other=0.0).to(tl.float32)
        at = tl.load(base_a + rs[:, None] * stride_ar + ks[None, :],
                     mask=r_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(at * xv[None, :], axis=1)  # (BLOCK_R,)
    tl.store(out + tok * stride_o + rs, acc, mask=r_ok)


def lora_shrink(x: torch.Tensor,  # (T, K)
                a_stack: torch.Tensor,  # (S, R, K): slot s's A
                out: torch.Tensor,  # (T, R) float32; rows of base tokens are left as they are
                seg_start: torch.Tensor,  # (G,) int32 first row of each segment
                seg_len: torch.Tensor,  # (G,) int32 rows (0: an unused entry)
                seg_slot: torch.Tensor,  # (G,) int32 slot, -1: the base model
                max_seg_len: int) -> torch.Tensor:
    """SGMV shrink over segments. `max_seg_len`: a bound on every segment's length (the token
    count, for a graph captured per batch size)."""
    check_lora_operands(x, a_stack, out, fp32=out)
    if x.shape[0] == 0 or max_seg_len == 0:
        return out
    check_launchable(_sgmv_shrink_kernel, x.device)
    r = a_stack.shape[1]
    grid = (seg_slot.shape[0], cdiv(max_seg_len, BLOCK_M))
    _sgmv_shrink_kernel[grid](
        x, a_stack, out, seg_start, seg_len, seg_slot, x.stride(0), a_stack.stride(0),
        a_stack.stride(1), out.stride(0), x.shape[1], r, BLOCK_M=BLOCK_M,
        BLOCK_R=max(16, next_pow2(r)), BLOCK_K=BLOCK_K)
    return out


def lora_shrink_tokens(x: torch.Tensor,  # (T, K)
                       a_stack: torch.Tensor,  # (S, R, K)
                       out: torch.Tensor,  # (T, R) float32
                       token_slot: torch.Tensor,  # (T,) int32 slot per token, -1: base
                       ) -> torch.Tensor:
    """BGMV shrink: one program per token (decode)."""
    check_lora_operands(x, a_stack, out, fp32=out, token_slot=token_slot)
    if x.shape[0] == 0:
        return out
    check_launchable(_bgmv_shrink_kernel, x.device)
    r = a_stack.shape[1]
    _bgmv_shrink_kernel[(x.shape[0],)](
        x, a_stack, out, token_slot, x.stride(0), a_stack.stride(0), a_stack.stride(1),
        out.stride(0), x.shape[1], r, BLOCK_R=next_pow2(r), BLOCK_K=BLOCK_K)
    return out
