"""A mixture-of-experts layer's experts on quantized weights (a quantized checkpoint's, or
`--quantization fp8`'s): one copy of the weights, in the layout of the path that runs them.

Owns: choosing that path and holding that copy. On CPU, the native op
(model/moe_kernel.py's moe_experts_quant: csrc/moe/moe_quant.cpp, W4A16 / W8A16 / FP8 codes
dequantized in registers) on quantization/experts.py's packed layout; on the model's fused
path (CUDA's Triton backend, or the interpreter) the Triton fused MoE with the B tile
dequantized in the kernel (triton_kernels/fused_moe_quant.py's layout); elsewhere (no native
build, RADIXSERVE_NO_CPU_KERNELS=1), and for the fused model's unfused forward (KV
calibration), the torch grouped compute of layers/moe.py with each active expert dequantized
for its GEMMs and dropped after (one expert's float weights at a time, never the layer's).
Also Qwen2-MoE's shared expert on quantized weights (QuantSharedExpert, the dense layers'
quantized kernels). Does not know: routing (the caller's Routing), checkpoints.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixserve.model.layers.linear import LinearKernel
from radixserve.model.layers.moe import grouped_experts
from radixserve.model.layers.moe_types import DequantizedExperts, Routing
from radixserve.model.moe_kernel import MoEExpertsOp, load_moe_experts_quant
from radixserve.model.quantization.experts import (
    PackedExperts,
    StackedQWeight,
    pack_experts_for_cpu,
)

if TYPE_CHECKING:
    from triton_kernels.fused_moe_quant import MoEQuantWeight


def _gpu_layout(w: StackedQWeight, device: torch.device) -> MoEQuantWeight:
    from triton_kernels.fused_moe_quant import prepare_experts  # needs triton

    return prepare_experts(int(w.kind), w.codes, w.scale, w.zero, w.group_size, device)


def _to(w: StackedQWeight, device: torch.device) -> StackedQWeight:
    return StackedQWeight(w.kind, w.codes.to(device), w.scale.to(device),
                          None if w.zero is None else w.zero.to(device), w.group_size)


class QuantExperts:
    """sum over each token's local top-k experts of weight * down(silu(gate(x)) * up(x)) on
    quantized gate_up (E, 2F, hidden) and down (E, hidden, F)."""

    def __init__(self, gate_up: StackedQWeight, down: StackedQWeight, num_experts: int,
                 first_expert: int, fused: bool, native: bool = True,
                 device: torch.device | None = None) -> None:
        """`fused`: built for the model's fused (Triton) path; `native`: the CPU op where it
        builds (else the torch path); `device`: the model's (default: the weights')."""
        device = gate_up.device if device is None else device
        self.num_experts, self.first_expert = num_experts, first_expert
        self.num_local, two_f, _ = gate_up.shape
        self.inter = two_f // 2
        self.op: MoEExpertsOp | None = None
        self.cpu: tuple[PackedExperts, PackedExperts] | None = None
        self.gpu: tuple[MoEQuantWeight, MoEQuantWeight] | None = None
        self.stacked: tuple[StackedQWeight, StackedQWeight] | None = None
        if fused:
            self.gpu = (_gpu_layout(gate_up, device), _gpu_layout(down, device))
            return
        self.op = load_moe_experts_quant(device) if native else None
        if self.op is not None:
            self.cpu = (pack_experts_for_cpu(gate_up, halves=True),
                        pack_experts_for_cpu(down, halves=False))
        else:
            self.stacked = (_to(gate_up, device), _to(down, device))

    @property
    def nbytes(self) -> int:
        held = self.cpu or self.gpu or self.stacked
        assert held is not None
        return sum(w.nbytes for w in held)

    def _dequantizers(self, dtype: torch.dtype) -> tuple[DequantizedExperts, DequantizedExperts]:
        if self.gpu is not None:
            from triton_kernels.fused_moe_quant import dequantize_expert

            gu, dn = self.gpu
            return (DequantizedExperts(lambda e: dequantize_expert(gu, e), self.num_local, dtype),
                    DequantizedExperts(lambda e: dequantize_expert(dn, e), self.num_local, dtype))
        assert self.stacked is not None
        sgu, sdn = self.stacked
        return (DequantizedExperts(lambda e: sgu.expert(e).dequantize(), self.num_local, dtype),
                DequantizedExperts(lambda e: sdn.expert(e).dequantize(), self.num_local, dtype))

    def __call__(self, x: torch.Tensor, routing: Routing, fused: bool = False
                 ) -> torch.Tensor:  # (T, hidden)
        if fused and self.gpu is not None:
            from triton_kernels.fused_moe import fused_moe

            return fused_moe(x, routing.weights, routing.expert_ids, self.gpu[0], self.gpu[1],
                             first_expert=self.first_expert)
        if self.op is not None:
            assert self.cpu is not None
            gu, dn = self.cpu
            return self.op(x, routing.weights, routing.expert_ids, gu.codes, gu.scale, gu.zero,
                           int(gu.kind), gu.group_size, dn.codes, dn.scale, dn.zero,
                           int(dn.kind), dn.group_size, self.inter, self.first_expert)
        gate_up, down = self._dequantizers(x.dtype)
        return grouped_experts(x, routing, gate_up, down, self.num_experts, self.first_expert)


class QuantSharedExpert:
    """Qwen2-MoE's shared expert on quantized weights: down(silu(gate(x)) * up(x)) with the
    dense layers' quantized kernels (QuantLinear: a quantized checkpoint's, or
    --quantization fp8's). No residual, no all-reduce: the block's caller adds and reduces."""

    def __init__(self, gate_up: LinearKernel, down: LinearKernel) -> None:
        self.gate_up, self.down = gate_up, down

    @property
    def nbytes(self) -> int:
        return self.gate_up.nbytes + self.down.nbytes

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        assert residual is None, "the block adds the residual"
        gu = self.gate_up(x)  # (T, 2 * S)
        inter = gu.shape[1] // 2
        return self.down(F.silu(gu[:, :inter]) * gu[:, inter:])  # (T, hidden)
