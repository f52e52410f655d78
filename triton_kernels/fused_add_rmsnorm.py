"""RMSNorm in one kernel, with or without the residual add before it (SGLang's fused_add_rmsnorm).

Owns: the row-wise norm kernel and its two wrappers, `rms_norm` (y = norm(x) * w) and
`fused_add_rmsnorm` (residual += x; x = norm(residual) * w, both in place). Does not know:
layers or where the residual stream lives.

Numerics follow HF's LlamaRMSNorm operation by operation: the residual add rounds once to
the input dtype (as torch's `residual + x`), the mean of squares and the scale by
rsqrt(mean + eps) run in fp32 on that rounded sum, the normalized row is rounded to the
input dtype, then multiplied by the weight and rounded again. Only the order of the
sum of squares differs from torch's reduction. Tolerances against
`reference.fused_add_rmsnorm_ref` (tests/triton_kernels/test_fused_kernels.py): the new
residual is bit-identical in every dtype; the output is within rtol = atol = 1e-6 in fp32 and
rtol = atol = 2**-7 (one bf16 rounding step) in bf16.
FP contraction is off (`enable_fp_fusion=False`), so no product is fused into an FMA that
torch would round separately.

NOTE (host cost): the argument checks cost several microseconds a call, as much as the launch
itself in a decode step; `check=False` skips them for a caller that has checked the same
layout already (model/layers/ check layer 0's calls of each forward, and the other
layers' operands share its shapes, dtypes and devices).
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (triton is untyped, and @triton.jit kernel parameters carry no Python types.)

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_kernels._common import KV_DTYPES, check_launchable, next_pow2
from triton_kernels._rounding import round_to


@triton.jit
def _rmsnorm_kernel(
    x, residual, weight, out, eps,
    stride_x, stride_r, stride_o,
    N: tl.constexpr, BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    # One program per row; the whole row is one block (N <= BLOCK).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    dtype = x.dtype.element_ty
    v = tl.load(x + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        s = round_to(v + r, dtype)  # the new residual, rounded as torch's add rounds it
        tl.store(residual + row * stride_r + offs, s, mask=mask)
        v = s.to(tl.float32)
    # IEEE sqrt and division (tl.sqrt is the approximate one): the interpreter's results.
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(tl.sum(v * v, axis=0), N * 1.0) + eps))
    normed = round_to(v * rstd, dtype).to(tl.float32)  # HF rounds before the weight's multiply
    w = tl.load(weight + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + row * stride_o + offs, round_to(normed * w, dtype), mask=mask)


def _check_rows(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    assert t.shape == like.shape, f"{name} must be {tuple(like.shape)}, got {tuple(t.shape)}"
    assert t.dtype == like.dtype, f"{name} is {t.dtype}, expected {like.dtype}"
    assert t.device == like.device, f"{name} is on {t.device}, expected {like.device}"
    assert t.stride(1) == 1, f"{name} rows must be contiguous, strides {t.stride()}"


def _check(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
           out: torch.Tensor) -> None:
    assert x.dim() == 2, f"x must be (rows, hidden), got {tuple(x.shape)}"
    assert x.dtype in KV_DTYPES, f"unsupported dtype {x.dtype}"
    assert x.stride(1) == 1, f"x rows must be contiguous, strides {x.stride()}"
    hidden = x.shape[1]
    assert weight.shape == (hidden,) and weight.dtype == x.dtype and weight.is_contiguous(), (
        f"weight must be a contiguous ({hidden},) {x.dtype} tensor, got "
        f"{tuple(weight.shape)} {weight.dtype}"
    )
    assert weight.device == x.device
    _check_rows("out", out, x)
    if residual is not None:
        _check_rows("residual", residual, x)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            out: torch.Tensor, eps: float) -> None:
    if x.shape[0] == 0:
        return
    check_launchable(_rmsnorm_kernel, x.device)
    hidden = x.shape[1]
    block = next_pow2(hidden)
    res = residual if residual is not None else x  # not read without HAS_RESIDUAL
    _rmsnorm_kernel[(x.shape[0],)](
        x, res, weight, out, eps, x.stride(0), res.stride(0), out.stride(0),
        N=hidden, BLOCK=block, HAS_RESIDUAL=residual is not None,
        num_warps=max(1, min(16, block // 256)), enable_fp_fusion=False,
    )


def rms_norm(
    x: torch.Tensor,  # (T, hidden), rows contiguous
    weight: torch.Tensor,  # (hidden,)
    eps: float,
    out: torch.Tensor | None = None,  # (T, hidden); may be x itself
    *,
    check: bool = True,
) -> torch.Tensor:  # (T, hidden)
    """norm(x) * weight, in x's dtype (fp32 statistics). Writes `out` (a new tensor if None).
    `check=False` skips the argument checks (see the module's NOTE)."""
    out = torch.empty_like(x) if out is None else out
    if check:
        _check(x, None, weight, out)
    _launch(x, None, weight, out, eps)
    return out


def fused_add_rmsnorm(
    x: torch.Tensor,  # (T, hidden), rows contiguous; overwritten with the normalized rows
    residual: torch.Tensor,  # (T, hidden), rows contiguous; overwritten with x + residual
    weight: torch.Tensor,  # (hidden,)
    eps: float,
    *,
    check: bool = True,
) -> torch.Tensor:  # x
    """residual += x; x = norm(residual) * weight. In place (each program reads its row
    before writing it, and x and residual must not overlap); returns x. `check=False` skips
    the argument checks (see the module's NOTE)."""
    if check:
        assert x.data_ptr() != residual.data_ptr(), "x and residual must be distinct tensors"
        _check(x, residual, weight, x)
    _launch(x, residual, weight, x, eps)
    return x
