"""The native skinny GEMM for CPU decode steps: its bound, build, load and reference.

Owns: `MAX_ROWS` (the row counts at or below which the float linears use it instead of
oneDNN), loading csrc/skinny_gemm.cpp's op `skinny_linear` at the process's CPU tier
(platform/kernels.py's SKINNY_GEMM, built per tier) and `skinny_reference`, its specification
in float64. Does not know: layers (cpu_linear.py's Linear and GateUp call it).

The op: skinny_linear(x (M, K), w (N, K), bias (N,) | None, residual (M, N) | None,
up (N, K) | None) -> y (M, N) in x's dtype:
  up None: y = x @ w.T + bias + residual
  up given (no bias, no residual): y = silu(x @ w.T) * (x @ up.T)
x float32 or bfloat16, w (and up, bias) float32 or bfloat16, the weight in its plain (N, K)
layout (no repacking: oneDNN multiplies the same tensor for prefill), fp32 accumulation (bf16
x with bf16 w on avx512_bf16 / amx: vdpbf16ps, exact products, denormals flushed), one
rounding to x's dtype. Each output row is computed the same way whatever M is, so a
request's tokens do not depend on what else is in its batch (csrc/skinny_gemm.h).

Opt-in (`RADIXSERVE_CPU_SKINNY_GEMM=1`, read at model load), because it trades: batch-1
decode gets closer to the memory floor (1.6-1.9x of it from 2.2-3.1x, one thread; 1.4-1.9x
with the weights in 2 MB pages, model/weight_memory.py), but the weight stays plain, so
oneDNN's prefill on it is 6-67% slower than on its prepacked layout (16-256 rows), and at 8
rows the op is slower than oneDNN prepacked (bench/README.md, "Decode at the memory floor").
Off, or where the build fails, or with RADIXSERVE_NO_CPU_KERNELS=1,
the float linears keep oneDNN's prepacked weights.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from radixserve.platform.kernels import SKINNY_GEMM, load_extension

# At or below this many rows (a decode step's batch) the float linears run the skinny GEMM;
# above it oneDNN's GEMM on the plain weight. The op wins up to 8 rows on every tier and dtype
# measured; oneDNN from 12 in fp32 and on avx512_bf16 in bf16 (capped tiers' bf16: the op still
# wins at 12-16; one bound kept). bench/README.md, "Decode at the memory floor".
MAX_ROWS = 8

ENV_SKINNY = "RADIXSERVE_CPU_SKINNY_GEMM"  # "1": decode steps run the skinny op (opt-in)

# (x, w, bias, residual, up) -> y
SkinnyLinear = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None,
                         torch.Tensor | None, torch.Tensor | None], torch.Tensor]


def skinny_enabled() -> bool:
    """Whether $RADIXSERVE_CPU_SKINNY_GEMM opts the float linears into the skinny op."""
    return os.environ.get(ENV_SKINNY, "").strip() == "1"


def load_skinny_linear() -> SkinnyLinear | None:
    """skinny_linear at the process's tier, built on first use; None where unavailable."""
    loaded = load_extension(SKINNY_GEMM)
    if loaded is None:
        return None
    op: SkinnyLinear = loaded.op("skinny_linear")
    return op


def skinny_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                     residual: torch.Tensor | None = None, up: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """The op's specification in float64 (not rounded to x's dtype): (M, N)."""
    x64 = x.double()
    y = x64 @ w.double().T  # (M, N)
    if up is not None:
        return F.silu(y) * (x64 @ up.double().T)
    if bias is not None:
        y = y + bias.double()
    return y if residual is None else y + residual.double()
