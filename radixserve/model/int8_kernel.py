"""The native weight-only int8 GEMM for CPU: weight layout, build, load, reference.

Owns: the packed weight layout the kernel reads (`pack_int8_weight` / `unpack_int8_weight`),
loading csrc/int8_packed_gemm.cpp's op `int8_packed_gemm` at the process's CPU tier
(platform/kernels.py's INT8_GEMM, built per tier), and
`int8_gemm_reference`, its specification in float64. Does not know: layers, configs (quant.py's
Int8Linear holds the weight and calls the op).

The op: y (M, N) = x (M, K) @ (q (N, K) int8 * scale (N,) fp32).T, with q given packed, x
float32 or bfloat16, y in x's dtype, fp32 accumulation. On a CPU with AVX512-BF16 x is rounded
to bf16 and the int8 weights are widened to bf16 in the kernel (vdpbf16ps); elsewhere the same
tiling runs in fp32, 8-wide FMAs on AVX2 (the op `int8_packed_gemm_uses_bf16()` says which).

Packed layout: (ceil(N / 16), ceil(K / 2), 16, 2) int8, zero padded: per block of 16 output
channels and per pair of inputs, the 16 x 2 weights side by side (vdpbf16ps's operand order).

If the build fails (no compiler, no ninja) or RADIXSERVE_NO_CPU_KERNELS=1, `load_int8_gemm`
returns None and Int8Linear keeps torch's kernels (and the plain (N, K) layout).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from radixserve.platform.kernels import ENV_DISABLE, INT8_GEMM, load_extension

__all__ = ["ENV_DISABLE"]

SOURCE = Path(__file__).parent / "csrc" / "int8_packed_gemm.cpp"
BLOCK = 16  # output channels per packed block

# (x (M, K), packed weight, scale (N,), N) -> y (M, N)
Int8Gemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


def load_int8_gemm() -> Int8Gemm | None:
    """int8_packed_gemm at the process's tier, built on first use; None where unavailable."""
    loaded = load_extension(INT8_GEMM)
    if loaded is None:
        return None
    op: Int8Gemm = loaded.op("int8_packed_gemm")
    return op


def pack_int8_weight(qweight: torch.Tensor) -> torch.Tensor:
    """(N, K) int8 -> the kernel's (ceil(N / 16), ceil(K / 2), 16, 2) int8, zero padded."""
    n, k = qweight.shape
    n_pad, k_pad = -(-n // BLOCK) * BLOCK, -(-k // 2) * 2
    q = torch.zeros(n_pad, k_pad, dtype=torch.int8, device=qweight.device)
    q[:n, :k] = qweight
    return q.view(n_pad // BLOCK, BLOCK, k_pad // 2, 2).permute(0, 2, 1, 3).contiguous()


def unpack_int8_weight(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of pack_int8_weight: (N, K) int8."""
    blocks, pairs = packed.shape[:2]
    plain = packed.permute(0, 2, 1, 3).reshape(blocks * BLOCK, pairs * 2)
    return plain[:n, :k].contiguous()


def int8_gemm_reference(x: torch.Tensor, qweight: torch.Tensor,
                        scale: torch.Tensor) -> torch.Tensor:
    """What the kernel computes, in float64 on the dequantized (N, K) weight; (M, N) in x's
    dtype."""
    w = qweight.double() * scale.double()[:, None]  # (N, K)
    return (x.double() @ w.t()).to(x.dtype)
