"""The panel GEMM for CPU linears: its weight layout, the packing, the op and its reference.

Owns: `PanelOp` (csrc/panel_gemm.cpp's `panel_linear` and its panel width, loaded at the
process's CPU tier: platform/kernels.py's PANEL_GEMM), `pack` / `pack_gated` (a weight (N, K)
into panels, once at load) and `panel_reference`, the op's specification in float64. Does not
know: layers (cpu_linear.py's Linear and GateUp hold the packed weights and call the op).

The layout: the output channels in panels of `width` (32 on AVX-512, 16 on AVX2 and in the
portable build; the last panel zero padded), each panel (K, width) fp32 or (ceil(K / 2),
width, 2) bf16 (a channel's inputs 2j and 2j + 1 side by side), the panels one after the
other. A decode step reads it as one sequential stream at the memory's bandwidth, and a
prefill tile of a few rows reuses each panel from cache: one copy of the weight serves both
(oneDNN's prepacked layout, the alternative, reads at about half the bandwidth for one row).
The gated form (SwiGLU) interleaves a gate panel and the up panel of the same channels.

The op: panel_linear(x (M, K), w (packed), n, bias (n,) fp32 | None, residual (M, n) | None,
gated) -> y (M, n) in x's dtype: x @ W.T + bias + residual, or silu(x @ G.T) * (x @ U.T).
fp32 accumulation, each output one sum over k in order (bf16 x with bf16 W on avx512_bf16 /
amx: pairs by vdpbf16ps), so a row's bits do not depend on M (batch invariance), one
rounding to x's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.platform.kernels import PANEL_GEMM, load_extension

# (x, packed w, n, bias, residual, gated) -> y
PanelLinear = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor | None,
                        torch.Tensor | None, bool], torch.Tensor]


@dataclass(frozen=True)
class PanelOp:
    """The op at one tier and the panel width its build multiplies."""

    linear: PanelLinear
    width: int


def load_panel_op() -> PanelOp | None:
    """The op at the process's tier, built on first use; None where unavailable."""
    loaded = load_extension(PANEL_GEMM)
    if loaded is None:
        return None
    return PanelOp(loaded.op("panel_linear"), int(loaded.op("panel_width")()))


def pack(weight: torch.Tensor, width: int) -> torch.Tensor:
    """weight (N, K) fp32 or bf16 -> (P, K, width) fp32 or (P, ceil(K / 2), width, 2) bf16,
    P = ceil(N / width); a fresh contiguous tensor (the plain weight can be freed)."""
    n, k = weight.shape
    panels = -(-n // width)
    w = F.pad(weight, (0, k % 2 if weight.dtype == torch.bfloat16 else 0, 0, panels * width - n))
    w = w.view(panels, width, w.shape[1])  # (P, width, K')
    if weight.dtype == torch.float32:
        return w.transpose(1, 2).contiguous()  # (P, K, width)
    assert weight.dtype == torch.bfloat16, weight.dtype
    return w.view(panels, width, -1, 2).transpose(1, 2).contiguous()  # (P, K'/2, width, 2)


def pack_gated(gate: torch.Tensor, up: torch.Tensor, width: int) -> torch.Tensor:
    """gate, up (N, K) -> their panels interleaved: gate panel p, then up panel p."""
    g, u = pack(gate, width), pack(up, width)  # (P, ...) each
    return torch.stack((g, u), dim=1).flatten(0, 1)  # (2P, ...)


def unpack(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The inverse of `pack`: (n, k) (for tests and for reading a packed weight back)."""
    if packed.dim() == 3:  # fp32 (P, K, width)
        return packed.transpose(1, 2).flatten(0, 1)[:n]
    p, half, width, _ = packed.shape  # bf16 (P, K'/2, width, 2)
    return packed.transpose(1, 2).reshape(p * width, half * 2)[:n, :k]


def panel_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
                    residual: torch.Tensor | None = None, up: torch.Tensor | None = None
                    ) -> torch.Tensor:
    """The op's specification in float64 on the plain weights (not rounded): (M, N)."""
    x64 = x.double()
    y = x64 @ w.double().T  # (M, N)
    if up is not None:
        return F.silu(y) * (x64 @ up.double().T)
    if bias is not None:
        y = y + bias.double()
    return y if residual is None else y + residual.double()
