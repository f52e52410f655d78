"""QuantLinear: y = x @ W.T (+ bias) on a quantized weight, the Linear interface.

Owns: choosing the GEMM per device and holding the one copy of the weight it reads: on CPU
the native kernel's packed layout (cpu_kernel.py; int4 / int8 / fp8 dequantized in registers,
activations in the model's dtype; from PANEL_MIN_ROWS rows (prefill), panels of PANEL_ROWS
output channels dequantized to the activations' dtype and multiplied with torch's GEMM, one
panel at a time); on CUDA the Triton W4A16 GEMM (int4) and FP8 W8A8 GEMM
(fp8, dynamic per-token activation scales) of triton_kernels/quant_gemm.py; elsewhere (no
native build, int8 on CUDA) a dequantize-then-matmul over slices of at most
FALLBACK_ROWS output channels, so no full float copy of the weight ever exists. Projections
that cannot share one weight (GPTQ act-order q/k/v with different orders) stay separate
GEMMs whose outputs are concatenated. Does not know: checkpoint formats, the model.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

from radixserve.model.quantization.cpu_kernel import (
    PackedWeight,
    QuantGemm,
    load_quant_dequantize,
    load_quant_gemm,
    pack_for_cpu,
)
from radixserve.model.quantization.qweight import Kind, QWeight, can_stack, stack_rows

if TYPE_CHECKING:
    from triton_kernels.quant_gemm import GpuQuantWeight

FALLBACK_ROWS = 256  # output channels dequantized at a time without a kernel
# From this many rows the native path dequantizes panels and runs torch's (oneDNN) GEMM on
# them: its blocking beats the in-register kernel once the dequantization is shared by many
# rows (figures: bench/quant_formats.py, docs/quantization.md).
PANEL_MIN_ROWS = 32
# Output channels per dequantized panel: 1024 x K values at a time (16 MiB of bf16 at
# K = 8192), few enough parallel regions that their start-up stays small.
PANEL_ROWS = 1024


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


class _Part:
    """One weight (one GEMM) on its device, in the layout its kernel reads."""

    def __init__(self, w: QWeight, device: torch.device, gemm: QuantGemm | None) -> None:
        self.n, self.k = w.shape
        self.perm = None if w.perm is None else w.perm.to(device)
        self.gemm = gemm if device.type == "cpu" else None
        self.packed: PackedWeight | None = None
        self.weight: QWeight | None = None
        self.gpu: GpuQuantWeight | None = None
        if self.gemm is not None:
            self.packed = pack_for_cpu(w)
        elif device.type == "cuda" and _has_triton_kernel(w):
            from triton_kernels.quant_gemm import prepare_weight  # needs triton

            self.gpu = prepare_weight(int(w.kind), w.codes, w.scale, w.zero, w.group_size,
                                      device)
        else:
            self.weight = QWeight(w.kind, w.codes.to(device), w.scale.to(device),
                                  None if w.zero is None else w.zero.to(device), w.group_size)

    @staticmethod
    def _panels(x: torch.Tensor, p: PackedWeight) -> torch.Tensor:  # (M, K) -> (M, N)
        outs = [x @ _dequantize_rows(p, n0, min(n0 + PANEL_ROWS, p.n), x.dtype)
                for n0 in range(0, p.n, PANEL_ROWS)]  # (M, <= PANEL_ROWS) each
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

    @property
    def nbytes(self) -> int:
        if self.packed is not None:
            return self.packed.nbytes
        if self.gpu is not None:
            return self.gpu.nbytes
        assert self.weight is not None
        w = self.weight
        return _nbytes(w.codes) + _nbytes(w.scale) + _nbytes(w.zero)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (M, K) -> (M, N)
        if self.perm is not None:
            x = x.index_select(1, self.perm)  # (M, K) in the weight's column order
        if self.packed is not None:
            assert self.gemm is not None
            p = self.packed
            if x.shape[0] >= PANEL_MIN_ROWS and x.dtype in (torch.float32, torch.bfloat16):
                return self._panels(x, p)
            return self.gemm(x.contiguous(), p.codes, p.scale, p.zero, int(p.kind), p.n,
                             p.group_size)
        if self.gpu is not None:
            from triton_kernels.quant_gemm import quant_matmul

            return quant_matmul(x, self.gpu)
        assert self.weight is not None
        w = self.weight
        outs = [F.linear(x, _rows(w, r, r + FALLBACK_ROWS).dequantize().to(x.dtype))
                for r in range(0, self.n, FALLBACK_ROWS)]  # (M, <= FALLBACK_ROWS) each
        return torch.cat(outs, dim=1)


def _dequantize_rows(p: PackedWeight, n0: int, n1: int, dtype: torch.dtype) -> torch.Tensor:
    """Output channels [n0, n1) dequantized by the native op: W[n0:n1].T, (K, n1 - n0) in
    `dtype`."""
    op = load_quant_dequantize()
    assert op is not None, "packed weights exist only where the native build loaded"
    w: torch.Tensor = op(
        p.codes, p.scale, p.zero, int(p.kind), p.n, p.k, p.group_size, n0, n1, dtype)
    return w


def _has_triton_kernel(w: QWeight) -> bool:
    """int4 (W4A16), and fp8 whose groups are whole K tiles (W8A8); int8 has none."""
    if w.kind is Kind.INT4:
        return True
    return w.kind is Kind.FP8 and (w.group_size >= w.shape[1] or w.group_size % 16 == 0)


def _rows(w: QWeight, start: int, stop: int) -> QWeight:
    return w.rows(slice(start, stop))


class QuantLinear:
    """y = x @ W.T (+ bias) for W one or several stacked quantized projections of x."""

    def __init__(self, parts: list[QWeight], bias: torch.Tensor | None, device: torch.device,
                 gemm: QuantGemm | None | Literal["load"] = "load") -> None:
        """`gemm`: the native CPU kernel from load_quant_gemm(), loaded once by the model's
        builder for all its layers ("load": this layer loads it; None: no native kernel)."""
        if gemm == "load":
            gemm = load_quant_gemm() if device.type == "cpu" else None
        weights = [stack_rows(parts)] if can_stack(parts) else parts
        self.kind = weights[0].kind
        self.parts = [_Part(w, device, gemm) for w in weights]
        self.bias = bias
        self.out_features = sum(p.n for p in self.parts)
        self.in_features = self.parts[0].k

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts) + _nbytes(self.bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (M, K) -> (M, N) in x's dtype
        ys = [p(x) for p in self.parts]
        y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=1)  # (M, N)
        return y if self.bias is None else y + self.bias

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + x @ W.T (+ bias); (M, N)."""
        return residual + self(x)
