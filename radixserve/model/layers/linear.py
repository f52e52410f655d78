"""Linear layers: the per-layer linear method (how a weight is stored and multiplied), the
LoRA hook on a layer's output, and the tensor-parallel row-parallel output into the residual.

Owns: `LinearMethod` (chosen once at load time: plain/prepacked float weights, int8 weights,
`--quantization fp8` and pre-quantized checkpoints: model/quantization/methods.py), `LinearLayer` (a kernel from the
method, the layer's name and its fused output slices for a LoRA hook) and
`RowParallelLinear` (o_proj, down: the all-reduce of the ranks' partial sums and the residual
add as the GEMM's epilogue where the kernel has one). Does not know: families, configs,
checkpoint names (weights.py slices each rank's rows and columns before the method sees them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, Protocol

import torch

from radixserve.model.cpu_linear import GateUp, Linear, Panel, load_default_panel
from radixserve.model.int8_kernel import Int8Gemm, load_int8_gemm
from radixserve.model.layers.norm import Residual
from radixserve.model.quant import Int8Linear
from radixserve.model.quantization.config import QuantConfig
from radixserve.model.quantization.cpu_kernel import load_quant_gemm
from radixserve.model.quantization.methods import CheckpointMethod, Fp8Method
from radixserve.model.quantization.qweight import LinearWeight

if TYPE_CHECKING:
    from radixserve.parallel.comm import TPComm

QUANTIZATIONS = ("int8", "fp8")  # load-time quantization of a float checkpoint


class LinearKernel(Protocol):
    """y = x @ W.T (+ bias) in some storage; add_to fuses a residual where it can."""

    @property
    def nbytes(self) -> int: ...
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...  # (M, in) -> (M, out)
    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor: ...


class LinearMethod(Protocol):
    """How every linear layer of a model is stored and multiplied (one per model, chosen at
    load time from --quantization or, for a quantized checkpoint, from its config)."""

    @property
    def name(self) -> str: ...  # "float", "int8", ...

    def create(self, weight: LinearWeight, bias: torch.Tensor | None, *,
               prepacked: bool = True) -> LinearKernel:
        """The kernel for this (rank's) weight (out, in) (a float tensor, or a quantized
        checkpoint's QWeights) and bias (out,)."""
        ...

    def swiglu(self, gate_up: LinearWeight) -> GateUp | None:
        """gate and up as the fused SwiGLU kernel (cpu_linear.GateUp: the panel GEMM, or
        oneDNN's epilogues); None: this method has no such form, the MLP runs one gate_up
        GEMM."""
        ...


@dataclass(frozen=True)
class FloatMethod:
    """Weights in the model dtype: on CPU the panel GEMM, or oneDNN's prepacked weights
    (cpu_linear.py), else F.linear. `panel`: the op loaded once for every layer."""

    name: str = "float"
    panel: Panel = "load"

    def create(self, weight: LinearWeight, bias: torch.Tensor | None, *,
               prepacked: bool = True) -> LinearKernel:
        assert isinstance(weight, torch.Tensor), "quantized weights need their method"
        return Linear(weight, bias, prepacked, self.panel)

    def swiglu(self, gate_up: LinearWeight) -> GateUp | None:
        assert isinstance(gate_up, torch.Tensor)
        return GateUp.make(gate_up, self.panel)


@dataclass(frozen=True)
class Int8Method:
    """Per-channel int8 weights (quant.py); the native kernel loaded once for every layer."""

    gemm: Int8Gemm | None | Literal["load"] = None
    name: str = "int8"

    def create(self, weight: LinearWeight, bias: torch.Tensor | None, *,
               prepacked: bool = True) -> LinearKernel:
        assert isinstance(weight, torch.Tensor), "int8 quantizes float weights"
        return Int8Linear(weight, bias, self.gemm)

    def swiglu(self, gate_up: LinearWeight) -> GateUp | None:
        return None


def linear_method(quantization: str | None, device: torch.device,
                  checkpoint: QuantConfig | None = None) -> LinearMethod:
    """The method for --quantization (validated at the edge: EngineConfig, and against the
    checkpoint by quantization/config.py's resolve_quantization) or for the checkpoint's own
    quantization_config (`checkpoint`)."""
    # One load (or one failed build) of the native kernel for every layer, not one each.
    qgemm = load_quant_gemm if device.type == "cpu" else (lambda: None)
    if quantization == "fp8":
        return Fp8Method(qgemm())
    if checkpoint is not None:
        return CheckpointMethod(checkpoint.method, device, qgemm())
    if quantization is None:
        return FloatMethod(panel=load_default_panel(device))
    if quantization == "int8":
        # One load (or one failed build) of the int8 kernel for every layer, not one each.
        return Int8Method(load_int8_gemm() if device.type == "cpu" else None)
    raise ValueError(f"unknown quantization {quantization!r}; supported: {QUANTIZATIONS}")


class LoraHook(Protocol):
    """Adds each token's adapter delta to a linear layer's output, in place (h-lora)."""

    def __call__(self, layer: LinearLayer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x (M, in), y (M, out) the base output (plus a residual where fused): y + delta."""
        ...


@dataclass
class LinearLayer:
    """One projection of a decoder layer: its kernel, name ("qkv_proj", "o_proj",
    "gate_up_proj", "down_proj", ...), layer index and output slices (fused qkv: q, k, v
    widths; gate_up: gate, up), so that a LoRA hook can place each sub-projection's delta."""

    kernel: LinearKernel
    name: str
    layer: int
    out_slices: tuple[int, ...]
    lora: LoraHook | None = field(default=None)

    @property
    def nbytes(self) -> int:
        return self.kernel.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (M, in) -> (M, out)
        y = self.kernel(x)
        return y if self.lora is None else self.lora(self, x, y)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel.add_to(residual, x)  # (M, out)
        return y if self.lora is None else self.lora(self, x, y)


@dataclass
class RowParallelLinear(LinearLayer):
    """An output projection (o_proj, down): under TP each rank holds some input columns and
    its output is a partial sum, all-reduced here."""

    tp: TPComm | None = None

    def reduced(self, x: torch.Tensor) -> torch.Tensor:
        """The whole output (M, out), summed over the ranks."""
        y = self(x)
        return y if self.tp is None else self.tp.all_reduce(y)

    def into(self, stream: Residual, x: torch.Tensor) -> None:
        """stream += this projection of x (summed over the ranks)."""
        if stream.fused:  # the next norm adds it, fused
            stream.add(self.reduced(x))
            return
        if self.tp is None:
            stream.h = self.add_to(stream.h, x)  # the add as the GEMM's epilogue
            return
        # Rank 0 alone adds the residual, so the all-reduced sum is the new residual.
        part = self.add_to(stream.h, x) if self.tp.is_lead else self(x)
        stream.h = self.tp.all_reduce(part)
