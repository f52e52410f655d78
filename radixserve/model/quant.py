"""Int8 weights for the linear layers: per-output-channel symmetric quantization and the matmul.

Owns: turning a float weight (N, K) into int8 values plus one fp32 scale per output row, the
reverse, and `Int8Linear`, which computes x @ W.T with the int8 weight as stored (it never
keeps a float copy). Does not know: the model's layers (llama.py decides which Linear is
quantized), configs, devices beyond "cpu or not".

Kernels on CPU (measured on a 2-core AVX512-BF16/VNNI EPYC without AMX, torch 2.13, SmolLM2-135M
shapes, 30 distinct layers, 1 thread; `python -m bench.quant_kernels`, see bench/README.md):
- up to NATIVE_MAX_ROWS (16) rows (decode of a few sequences): the project's native
  weight-only kernel (int8_kernel.py: activations rounded to bf16, int8 weights widened to
  bf16 in the kernel, fp32 accumulation): ~5x fp32's F.linear at 1 row (2x torch's
  `_weight_int8pack_mm`), ~3-5x at 4-16 rows. Activations are not quantized.
- more rows (batched decode, prefill): the activations are quantized per row (dynamic,
  symmetric) and `torch._int_mm` multiplies int8 by int8 into int32 (VNNI): ~2.5-3.5x fp32
  from 32 rows up, where the native kernel (bf16 compute, ~2x) is slower; but per-step
  agreement with fp32 drops from ~0.97 to ~0.89 (bench/README.md). The int32 result is
  rescaled by row scale x channel scale. RADIXSERVE_INT8_WEIGHT_ONLY=1: the native kernel at
  every row count instead.
- where the native kernel did not build (or RADIXSERVE_NO_CPU_KERNELS=1): torch's weight-only
  kernel for <= WEIGHT_ONLY_MAX_ROWS rows (bf16 activations; ~1x fp32 at 32 rows, so not
  above), `_int_mm` above.
- not on CPU (CUDA): weight-only: the int8 weight is widened to the activation dtype inside
  the call (correct by construction; no custom kernel is claimed).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from radixserve.model.int8_kernel import Int8Gemm, load_int8_gemm

QMAX = 127  # symmetric: -127..127, so that negation never overflows
# The native weight-only kernel (int8_kernel.py) at or below this many rows, int8 x int8 above:
# the measured crossover (bench/README.md: at 16 rows both ~1.1x each other, at 32 `_int_mm`
# is ~1.35x faster). ENV_ALL_WEIGHT_ONLY=1: the native kernel at every row count (quality:
# activations never quantized; per-step agreement with fp32 0.971 instead of 0.887, but
# decode at batch 32 and prefill slower).
NATIVE_MAX_ROWS = 16
ENV_ALL_WEIGHT_ONLY = "RADIXSERVE_INT8_WEIGHT_ONLY"
# Without the native kernel: at or below, torch's weight-only kernel; above: int8 x int8.
WEIGHT_ONLY_MAX_ROWS = 2
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

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 native: Int8Gemm | None | Literal["load"] = "load") -> None:
        """`native`: the kernel from load_int8_gemm(), loaded once by the model's builder for
        all its layers ("load": this layer loads it; None: torch's kernels only)."""
        w = quantize_per_channel(weight)
        self.qweight = w.qweight.to(weight.device)  # (N, K) int8
        self.scale = w.scale.to(weight.device)  # (N,) float32
        # The weight-only kernel wants its scales in the activations' dtype (bf16 here).
        self.scale_bf16 = self.scale.to(torch.bfloat16)
        self.bias = bias
        self.on_cpu = weight.device.type == "cpu"
        self.weight_only_ok = self.on_cpu and _has_weight_int8pack_mm()
        self.weight_only_max_rows = WEIGHT_ONLY_MAX_ROWS  # bench/quant.py raises it to compare
        # None where the build failed or RADIXSERVE_NO_CPU_KERNELS=1: torch's kernels only
        if native == "load":
            native = load_int8_gemm() if self.on_cpu else None
        self.native: Int8Gemm | None = native if self.on_cpu else None
        self.native_max_rows = (1 << 62) if os.environ.get(ENV_ALL_WEIGHT_ONLY) == "1" \
            else NATIVE_MAX_ROWS  # bench/quant.py sets it to compare

    @property
    def nbytes(self) -> int:
        n = self.qweight.numel() + self.scale.numel() * 4 + self.scale_bf16.numel() * 2
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (M, K) -> (M, N) in x's dtype
        if not self.on_cpu:
            y = F.linear(x, self.qweight.to(x.dtype)) * self.scale.to(x.dtype)
        elif self.native is not None and x.shape[0] <= self.native_max_rows:
            y = self.native(x, self.qweight, self.scale)
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
