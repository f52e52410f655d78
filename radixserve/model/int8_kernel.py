"""The native weight-only int8 GEMM for CPU: building and loading it, and its reference.

Owns: compiling csrc/int8_gemm.cpp with torch's C++ extension loader (as the attention kernel
is built: attention/cpu_kernels.py; cached per source version and CPU flags, -march=native,
-ffast-math on the compile step only), the op `torch.ops.radixserve.int8_weight_gemm`, and
`int8_weight_gemm_reference`, its specification in float64. Does not know: when the kernel is
used (quant.Int8Linear decides by row count).

The op: y (M, N) = x (M, K) @ (qweight (N, K) int8 * scale (N,) fp32).T, x float32 or
bfloat16, y in x's dtype, fp32 accumulation. On a CPU with AVX512-BF16 x is rounded to bf16
and the int8 weights are widened to bf16 in the kernel (vdpbf16ps); elsewhere the same tiling
runs in fp32 (`torch.ops.radixserve.int8_weight_gemm_uses_bf16()` says which).

If the build fails (no compiler, no ninja) or RADIXSERVE_NO_CPU_KERNELS=1, `load_int8_gemm`
returns None and Int8Linear keeps torch's kernels.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

from radixserve.attention.cpu_kernels import ENV_DISABLE, build_extension

SOURCE = Path(__file__).parent / "csrc" / "int8_gemm.cpp"
EXT_BASE = "radixserve_int8_gemm_v3"  # bump with the source: a fresh build, not a stale one

Int8Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _registered() -> bool:
    return hasattr(torch.ops.radixserve, "int8_weight_gemm")


def load_int8_gemm() -> Int8Gemm | None:
    """torch.ops.radixserve.int8_weight_gemm, built on first use; None where unavailable."""
    if os.environ.get(ENV_DISABLE) == "1":
        return None
    if not (_registered() or build_extension(EXT_BASE, [SOURCE], "CPU int8 GEMM kernel")):
        return None
    op: Int8Gemm = torch.ops.radixserve.int8_weight_gemm
    return op


def int8_weight_gemm_reference(x: torch.Tensor, qweight: torch.Tensor,
                               scale: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64 on the dequantized weight; (M, N) in x's dtype."""
    w = qweight.double() * scale.double()[:, None]  # (N, K)
    return (x.double() @ w.t()).to(x.dtype)
