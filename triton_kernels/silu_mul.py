"""SwiGLU's activation in one kernel: silu(gate) * up over the fused gate_up projection output.

Owns: the kernel and its wrapper. Does not know: the MLP's weights or the GEMMs around it.

Numerics as torch's `F.silu(gate) * up`: silu in fp32 on the input, rounded to the input
dtype, then the product (in fp32 of the two rounded operands) rounded again. exp may differ
from torch's in the last fp32 bits, so tests allow rtol = atol = 1e-6 in fp32 and
rtol = atol = 2**-7 (one bf16 rounding step) in bf16 against `reference.silu_mul_ref`.

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

from triton_kernels._common import KV_DTYPES, cdiv, check_launchable, next_pow2
from triton_kernels._rounding import round_to

BLOCK = 1024  # columns per program: a decode step's rows are short, a prefill's many


@triton.jit
def _silu_mul_kernel(gate_up, out, stride_g, stride_o, INTER: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    # grid (rows, column blocks): gate is columns [0, INTER) of a row, up is [INTER, 2 INTER).
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < INTER
    dtype = out.dtype.element_ty
    g = tl.load(gate_up + row * stride_g + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gate_up + row * stride_g + INTER + offs, mask=mask, other=0.0).to(tl.float32)
    act = round_to(tl.div_rn(g, 1.0 + tl.exp(-g)), dtype).to(tl.float32)  # IEEE division
    tl.store(out + row * stride_o + offs, round_to(act * u, dtype), mask=mask)


def _check(gate_up: torch.Tensor, out: torch.Tensor | None) -> None:
    assert gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0, (
        f"gate_up must be (tokens, 2 * inter), got {tuple(gate_up.shape)}")
    assert gate_up.dtype in KV_DTYPES, f"unsupported dtype {gate_up.dtype}"
    assert gate_up.stride(1) == 1, f"gate_up rows must be contiguous, strides {gate_up.stride()}"
    if out is None:
        return
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    assert tuple(out.shape) == (rows, inter), f"out must be {(rows, inter)}, got {out.shape}"
    assert out.dtype == gate_up.dtype and out.device == gate_up.device
    assert out.stride(1) == 1, f"out rows must be contiguous, strides {out.stride()}"


def silu_mul(
    gate_up: torch.Tensor,  # (T, 2 * inter): gate columns, then up columns
    out: torch.Tensor | None = None,  # (T, inter)
    *,
    check: bool = True,
) -> torch.Tensor:  # (T, inter)
    """silu(gate_up[:, :inter]) * gate_up[:, inter:]; writes `out` (a new tensor if None).
    `check=False` skips the argument checks (see the module's NOTE)."""
    if check:
        _check(gate_up, out)
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    if out is None:
        out = torch.empty(rows, inter, dtype=gate_up.dtype, device=gate_up.device)
    if rows == 0:
        return out
    check_launchable(_silu_mul_kernel, gate_up.device)
    block = min(BLOCK, next_pow2(inter))
    _silu_mul_kernel[(rows, cdiv(inter, block))](
        gate_up, out, gate_up.stride(0), out.stride(0), INTER=inter, BLOCK_N=block,
        num_warps=4, enable_fp_fusion=False,
    )
    return out
