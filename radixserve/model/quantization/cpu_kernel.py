"""The native CPU GEMM on quantized weights: packed layout, build, load, reference.

Owns: the packed layout csrc/quant_gemm.cpp reads (`pack_for_cpu`), building it per CPU tier
(platform/kernels.py's QUANT_GEMM), the ops `quant_gemm` and `quant_dequantize`, and `quant_gemm_reference` (dequantize, then matmul in
float64: the kernel's specification). Does not know: layers, checkpoint formats (QWeight).

Layout: blocks of 16 output channels (N padded with zero codes, zero scales): int4 codes
(NB, Kp / 2, 16) uint8 (Kp: K rounded up to even with a zero code), byte j of pair p holding
channel j's codes of inputs 2p (low nibble) and 2p + 1 (high nibble); int8 / fp8 codes
(NB, K, 16) uint8; scale and zero (NB, G, 16) float32 (csrc/quant_gemm.h says why). A weight with
`perm` (GPTQ act-order) is multiplied by x[:, perm] (the caller permutes the activations).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixserve.model.quantization.qweight import Kind, QWeight
from radixserve.platform.kernels import QUANT_GEMM, load_extension

BLOCK = 16  # output channels per packed block

# (x (M, K), packed, scale, zero, kind, N, group_size) -> y (M, N)
QuantGemm = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, int, int],
                     torch.Tensor]


@dataclass(frozen=True)
class PackedWeight:
    kind: Kind
    n: int
    k: int
    group_size: int
    codes: torch.Tensor  # (NB, Kp / 2, 16) or (NB, K, 16) uint8
    scale: torch.Tensor  # (NB, G, 16) float32
    zero: torch.Tensor  # (NB, G, 16) float32; empty for FP8

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))


def load_quant_gemm() -> QuantGemm | None:
    """quant_gemm at the process's CPU tier, built on first use; None where unavailable."""
    loaded = load_extension(QUANT_GEMM)
    if loaded is None:
        return None
    op: QuantGemm = loaded.op("quant_gemm")
    return op


def load_quant_dequantize() -> Callable[..., torch.Tensor] | None:
    """quant_dequantize (output channels of a packed weight, dequantized) at the process's
    CPU tier; None where unavailable."""
    loaded = load_extension(QUANT_GEMM)
    return None if loaded is None else loaded.op("quant_dequantize")


def _blocks(t: torch.Tensor, n_pad: int) -> torch.Tensor:
    """(N, X) -> (NB, X, 16), zero padded to n_pad rows."""
    padded = torch.zeros(n_pad, t.shape[1], dtype=t.dtype)
    padded[: t.shape[0]] = t
    return padded.view(n_pad // BLOCK, BLOCK, -1).transpose(1, 2).contiguous()


def pack_for_cpu(w: QWeight) -> PackedWeight:
    n, k = w.shape
    n_pad = -(-n // BLOCK) * BLOCK
    codes = _blocks(w.codes.cpu(), n_pad)  # (NB, K, 16)
    if w.kind is Kind.INT4:
        codes = torch.nn.functional.pad(codes, (0, 0, 0, k % 2))  # (NB, Kp, 16)
        pairs = codes.view(codes.shape[0], -1, 2, BLOCK)  # (NB, Kp / 2, 2, 16)
        codes = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).contiguous()  # (NB, Kp / 2, 16)
    zero = torch.empty(0) if w.zero is None else _blocks(w.zero.cpu(), n_pad)
    return PackedWeight(w.kind, n, k, w.group_size, codes, _blocks(w.scale.cpu(), n_pad), zero)


def quant_gemm_reference(x: torch.Tensor, w: QWeight) -> torch.Tensor:
    """x (M, K) @ dequantize(w).T in float64; (M, N) in x's dtype."""
    return (x.double() @ w.dequantize().double().t()).to(x.dtype)
