"""Rounding fp32 to a storage dtype inside a kernel, as torch rounds.

Owns: `round_to`, a @triton.jit helper the elementwise kernels (norm, RoPE, SiLU) share.
Does not know: any kernel's algorithm.
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (triton is untyped, and @triton.jit kernel parameters carry no Python types.)

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dtype: tl.constexpr):
    """fp32 `x` rounded to `dtype`, to nearest even, as torch rounds.

    NOTE (interpreter): triton 3.9's interpreter truncates fp32 -> bf16 casts, so bf16 rounds
    by hand here (carry the round bit, ties to even: what the GPU's cvt.rn gives). NaN
    payloads are not preserved (no kernel output is meant to be NaN).
    """
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)
