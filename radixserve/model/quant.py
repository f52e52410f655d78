"""Int8 weights for the linear layers: per-output-channel symmetric quantization and the matmul.

Owns: turning a float weight (N, K) into int8 values plus one fp32 scale per output row, the
reverse, and `Int8Linear`, which computes x @ W.T with the int8 weight as stored (it never
keeps a float copy). Does not know: the model's layers (llama.py decides which Linear is
quantized), configs, devices beyond "cpu or not".

Kernels (measured on a 2-core AVX512-BF16/VNNI EPYC without AMX, torch 2.13, SmolLM2-135M
shapes, 30 distinct layers, 1 thread; see bench/README.md):
- a handful of rows (decode of one or two sequences): torch's weight-only int8 kernel
  `aten._weight_int8pack_mm` on bf16 activations: 4x fp32's F.linear at 1 row. It is slow for
  more rows (0.5x fp32 at 32 rows) and very slow on fp32 activations (0.02x at 32 rows).
- more rows (batched decode, prefill): the activations are quantized per row (dynamic,
  symmetric) and `torch._int_mm` multiplies int8 by int8 into int32 (VNNI): 1.7x fp32 at
  32 rows, 2.8x at 2048. The int32 result is rescaled by row scale x channel scale.
- not on CPU (CUDA): weight-only: the int8 weight is widened to the activation dtype inside
  the call (correct by construction; no custom kernel is claimed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

QMAX = 127  # symmetric: -127..127, so that negation never overflows
WEIGHT_ONLY_MAX_ROWS = 2  # at or below: the weight-only kernel; above: int8 x int8
_MIN_SCALE = 1e-12  # an all-zero row still gets a finite scale (and dequantizes to zeros)


@dataclass(frozen=True)
class Int8Weight:
    qweight: torch.Tensor  # (N, K) int8
    scale: torch.Tensor  # (N,) float32: W[n, :] ~= qweight[n, :] * scale[n]

    @property
    def nbytes(self) -> int:
        return self.qweight.numel() * self.qweight.element_size() + \
            self.scale.numel() * self.scale.element_size()


def quantize_per_channel(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8: scale[n] = max|W[n, :]| / 127, q = round(W / scale)."""
    assert weight.dim() == 2, weight.shape
    w = weight.detach().float()  # (N, K)
    scale = (w.abs().amax(dim=1) / QMAX).clamp_min(_MIN_SCALE)  # (N,)
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return Int8Weight(q.contiguous(), scale.contiguous())


def dequantize(w: Int8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float weight (N, K) the int8 one stands for."""
    return (w.qweight.float() * w.scale[:, None]).to(dtype)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric per-row int8 of activations x (M, K): (xq int8 (M, K), scale (M, 1))."""
    xf = x.float()
    scale = (xf.abs().amax(dim=1, keepdim=True) / QMAX).clamp_min(_MIN_SCALE)  # (M, 1)
    xq = torch.round(xf / scale).clamp_(-QMAX, QMAX).to(torch.int8)
    return xq, scale


def _has_weight_int8pack_mm() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


class Int8Linear:
    """y = x @ W.T (+ bias) with W held as int8 plus per-channel scales; the Linear interface."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        w = quantize_per_channel(weight)
        self.qweight = w.qweight.to(weight.device)  # (N, K) int8
        self.scale = w.scale.to(weight.device)  # (N,) float32
        # The weight-only kernel wants its scales in the activations' dtype (bf16 here).
        self.scale_bf16 = self.scale.to(torch.bfloat16)
        self.bias = bias
        self.on_cpu = weight.device.type == "cpu"
        self.weight_only_ok = self.on_cpu and _has_weight_int8pack_mm()
        self.weight_only_max_rows = WEIGHT_ONLY_MAX_ROWS  # bench/quant.py raises it to compare

    @property
    def nbytes(self) -> int:
        n = self.qweight.numel() + self.scale.numel() * 4 + self.scale_bf16.numel() * 2
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (M, K) -> (M, N) in x's dtype
        if not self.on_cpu:
            y = F.linear(x, self.qweight.to(x.dtype)) * self.scale.to(x.dtype)
        elif x.shape[0] <= self.weight_only_max_rows and self.weight_only_ok:
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight,
                                                   self.scale_bf16).to(x.dtype)
        else:
            xq, xs = quantize_rows(x)
            acc = torch._int_mm(xq, self.qweight.t())  # (M, N) int32, exact
            y = acc.to(torch.float32).mul_(xs).mul_(self.scale).to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + x @ W.T (+ bias); (M, N)."""
        return residual + self(x)
