"""The gated MLP (SwiGLU or Gemma's GELU-tanh), and the FeedForward slot a MoE block fills.

Owns: act(gate) * up then down, with each device's kernel: on CPU with float weights and
SiLU, cpu_linear.GateUp (the panel GEMM, or oneDNN's GEMMs, with the silu and the product as
epilogues); on the fused path triton_kernels' silu_mul; else one
gate_up GEMM and torch.
Does not know: configs, checkpoint names, the residual's layout (RowParallelLinear.into).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from radixserve.model.cpu_linear import GateUp
from radixserve.model.layers.context import ForwardContext
from radixserve.model.layers.linear import LinearLayer, RowParallelLinear
from radixserve.model.layers.norm import Residual

ACTIVATIONS = ("silu", "gelu_tanh")


class FeedForward(Protocol):
    """A decoder layer's MLP slot: a dense gated MLP here, a MoE block (h-moe) alike."""

    @property
    def nbytes(self) -> int: ...

    def into(self, ctx: ForwardContext, stream: Residual, x: torch.Tensor) -> None:
        """stream += this block's output for the normalized x (T, hidden)."""
        ...

    def __call__(self, ctx: ForwardContext, x: torch.Tensor) -> torch.Tensor:
        """The block's output (T, hidden), all-reduced under TP (Gemma norms it first)."""
        ...


class GatedMLP:
    """down(act(x @ gate.T) * (x @ up.T)); `packed`: gate and up as cpu_linear.GateUp."""

    def __init__(self, gate_up: LinearLayer | None, down: RowParallelLinear, act: str,
                 packed: GateUp | None = None) -> None:
        assert act in ACTIVATIONS, act
        assert (gate_up is None) != (packed is None), "one form of gate/up"
        self.gate_up, self.down, self.act, self.packed = gate_up, down, act, packed

    @property
    def nbytes(self) -> int:
        halves = 0 if self.packed is None else self.packed.nbytes
        return halves + (0 if self.gate_up is None else self.gate_up.nbytes) + self.down.nbytes

    def activation(self, ctx: ForwardContext, x: torch.Tensor) -> torch.Tensor:
        """act(gate) * up: (T, hidden) -> (T, intermediate)."""
        if self.packed is not None:  # silu(x @ gate.T) * (x @ up.T), fused
            return self.packed(x)
        assert self.gate_up is not None
        gu = self.gate_up(x)  # (T, 2 * inter): gate columns, then up columns
        if self.act == "silu" and ctx.fused:
            from triton_kernels.silu_mul import silu_mul

            return silu_mul(gu, check=self.down.layer == 0)
        gate, up = gu.chunk(2, dim=-1)  # (T, inter) each
        if self.act == "silu":
            return F.silu(gate) * up
        return F.gelu(gate, approximate="tanh") * up

    def into(self, ctx: ForwardContext, stream: Residual, x: torch.Tensor) -> None:
        self.down.into(stream, self.activation(ctx, x))

    def __call__(self, ctx: ForwardContext, x: torch.Tensor) -> torch.Tensor:
        return self.down.reduced(self.activation(ctx, x))
