"""The linear methods of quantized models, for model/layers/linear.py's `linear_method`.

Owns: `CheckpointMethod` (a pre-quantized checkpoint: its QWeights become QuantLinears, the
layers it leaves unquantized, e.g. an `ignore` list, stay float as FloatMethod keeps them)
and `Fp8Method` (`--quantization fp8`: every linear weight of a float checkpoint quantized
to per-channel FP8 at load, as vLLM's flag does; the LM head stays in the model's dtype).
Does not know: families, checkpoint names, the forward pass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.model.cpu_linear import GateUp, Linear
from radixserve.model.quantization.cpu_kernel import QuantGemm
from radixserve.model.quantization.linear import QuantLinear
from radixserve.model.quantization.qweight import LinearWeight, quantize_fp8


@dataclass(frozen=True)
class CheckpointMethod:
    """The checkpoint's own quantized weights; `name` its quant_method."""

    name: str
    device: torch.device
    gemm: QuantGemm | None  # the native CPU kernel, loaded once for every layer

    def create(self, weight: LinearWeight, bias: torch.Tensor | None, *,
               prepacked: bool = True) -> QuantLinear | Linear:
        if isinstance(weight, list):
            return QuantLinear(weight, bias, self.device, self.gemm)
        return Linear(weight, bias, prepacked)  # a layer the checkpoint left in float

    def swiglu(self, gate_up: LinearWeight) -> GateUp | None:
        return None if isinstance(gate_up, list) else GateUp.make(gate_up)


@dataclass(frozen=True)
class Fp8Method:
    """Per-output-channel FP8 (e4m3) weights quantized at load from the float checkpoint."""

    gemm: QuantGemm | None
    name: str = "fp8"

    def create(self, weight: LinearWeight, bias: torch.Tensor | None, *,
               prepacked: bool = True) -> QuantLinear:
        if isinstance(weight, list):  # an FP8 checkpoint served with --quantization fp8
            return QuantLinear(weight, bias, weight[0].codes.device, self.gemm)
        return QuantLinear([quantize_fp8(weight)], bias, weight.device, self.gemm)

    def swiglu(self, gate_up: LinearWeight) -> GateUp | None:
        return None
