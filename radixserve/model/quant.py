"""Int8 weights for the linear layers: per-output-channel symmetric quantization and the matmul.

Owns: turning a float weight (N, K) into int8 values plus one fp32 scale per output row, the
reverse, and `Int8Linear`, which computes x @ W.T with the int8 weight as stored (it never
keeps a float copy). Weight-only: activations stay in their dtype (fp32 or bf16), never
quantized. Does not know: the model's layers (llama.py decides which Linear is quantized),
configs, devices beyond "cpu or not".

Kernels (their speed against fp32's F.linear: `python -m bench.quant_kernels`, figures in
bench/README.md):
- CPU: the project's native kernel (int8_kernel.py) at every row count, on the weight packed
  once at load time: activations rounded to bf16, int8 weights widened to bf16 in the kernel,
  fp32 accumulation. It beats fp32's F.linear at every row count: a quarter of the bytes
  read at one row, bf16 dot products at twice fp32's rate for batches.
- CPU where the native kernel did not build (or RADIXSERVE_NO_CPU_KERNELS=1): torch's
  weight-only `_weight_int8pack_mm` for <= WEIGHT_ONLY_MAX_ROWS rows, above that the int8
  weight widened to the activations' dtype inside the call (about fp32's speed).
- not on CPU (CUDA): the int8 weight widened to the activation dtype inside the call (correct
  by construction; no custom kernel is claimed).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from radixserve.model.int8_kernel import (
    Int8Gemm,
    load_int8_gemm,
    pack_int8_weight,
)

QMAX = 127  # symmetric: -127..127, so that negation never overflows
# Without the native kernel: at or below, torch's weight-only kernel (fast for a row or two,
# slower than a float matmul from a few rows up); above, the weight widened in the call.
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


def _has_weight_int8pack_mm() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


class Int8Linear:
    """y = x @ W.T (+ bias) with W held as int8 plus per-channel scales; the Linear interface.

    Holds one copy of the int8 weight: packed for the native kernel where it is loaded, else
    plain (N, K) for torch's kernels."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 native: Int8Gemm | None | Literal["load"] = "load") -> None:
        """`native`: the kernel from load_int8_gemm(), loaded once by the model's builder for
        all its layers ("load": this layer loads it; None: torch's kernels only)."""
        w = quantize_per_channel(weight)
        self.out_features, self.in_features = w.qweight.shape
        self.scale = w.scale.to(weight.device)  # (N,) float32
        self.bias = bias
        self.on_cpu = weight.device.type == "cpu"
        if native == "load":
            native = load_int8_gemm() if self.on_cpu else None
        self.native: Int8Gemm | None = native if self.on_cpu else None
        # Exactly one of the two layouts is kept.
        self.packed: torch.Tensor | None = None  # (N/16, K/2, 16, 2) int8: the native kernel's
        self.qweight: torch.Tensor | None = None  # (N, K) int8: torch's kernels'
        if self.native is not None:
            self.packed = pack_int8_weight(w.qweight)
        else:
            self.qweight = w.qweight.to(weight.device)
        # torch's weight-only kernel (None: not used) wants its scales in the activations'
        # dtype (bf16 there).
        weight_only = self.native is None and self.on_cpu and _has_weight_int8pack_mm()
        self.scale_bf16 = self.scale.to(torch.bfloat16) if weight_only else None

    @property
    def nbytes(self) -> int:
        q = self.packed if self.packed is not None else self.qweight
        assert q is not None
        n = q.numel() + self.scale.numel() * 4
        n += 0 if self.scale_bf16 is None else self.scale_bf16.numel() * 2
        return n + (0 if self.bias is None else self.bias.numel() * self.bias.element_size())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (M, K) -> (M, N) in x's dtype
        if self.native is not None:
            assert self.packed is not None
            y = self.native(x, self.packed, self.scale, self.out_features)
        elif x.shape[0] <= WEIGHT_ONLY_MAX_ROWS and self.scale_bf16 is not None:
            y = torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), self.qweight,
                                                   self.scale_bf16).to(x.dtype)
        else:
            assert self.qweight is not None
            y = F.linear(x, self.qweight.to(x.dtype)) * self.scale.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias
        return y

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + x @ W.T (+ bias); (M, N)."""
        return residual + self(x)
