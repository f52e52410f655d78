"""The types a mixture-of-experts layer's pieces pass between them (layers/moe.py, its
quantized experts in layers/moe_quant.py): the routing, the torch path's per-expert weight
access, and the protocols of the experts and shared expert the block runs.

Owns: nothing with behaviour beyond DequantizedExperts' one-expert dequantization. Does not
know: the routing math, kernels, checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import torch


class Routing(NamedTuple):
    weights: torch.Tensor  # (T, k) in the activations' dtype
    expert_ids: torch.Tensor  # (T, k) int64, global expert indices


class DequantizedExperts:
    """Quantized experts as the torch path indexes them: [e] is expert e's weight dequantized
    to `dtype` (made when asked, dropped after its GEMM: one expert's floats at a time)."""

    def __init__(self, dequantize: Callable[[int], torch.Tensor], num: int,
                 dtype: torch.dtype) -> None:
        self.dequantize, self.shape, self.dtype = dequantize, (num,), dtype

    def __getitem__(self, e: int) -> torch.Tensor:  # (N, K)
        return self.dequantize(e).to(self.dtype)


Experts = torch.Tensor | DequantizedExperts  # what the torch path's GEMMs index by expert


class SharedExpert(Protocol):
    """Qwen2-MoE's shared expert as the block calls it (cpu_linear.GatedMLP, or
    layers/moe_quant.py's QuantSharedExpert)."""

    @property
    def nbytes(self) -> int: ...

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor: ...


class ExpertsKernel(Protocol):
    """The experts of quantized weights (layers/moe_quant.py's QuantExperts)."""

    @property
    def nbytes(self) -> int: ...

    def __call__(self, x: torch.Tensor, routing: Routing, fused: bool = False
                 ) -> torch.Tensor: ...
