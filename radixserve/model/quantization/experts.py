"""A mixture-of-experts layer's quantized experts: the per-expert QWeights stacked per layer.

Owns: `StackedQWeight` (one projection of every local expert in QWeight's canonical form
with a leading expert dim: codes (E, N, K), scale and zero point (E, N, G)), stacking the
checkpoint's per-expert QWeights into it at load (every expert one kind, one group size, no
act-order permutation: else a ModelLoadError naming the layer), `--quantization fp8`'s
per-channel FP8 of stacked float experts, and the CPU kernel's packed layout of the stack
(`pack_experts_for_cpu`: cpu_kernel.py's blocks of 16 output channels, expert by expert, gate
and up packed apart so that block b of the gate and block NBf + b of the up are the same
intermediate channels). Does not know: checkpoint names (layers/moe_weights.py), kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.model.quantization.cpu_kernel import BLOCK, pack_for_cpu
from radixserve.model.quantization.qweight import Kind, QWeight, quantize_fp8, quantize_int
from radixserve.model_source import ModelLoadError


@dataclass(frozen=True)
class StackedQWeight:
    """W[e, n, k] = (code[e, n, k] - zero[e, n, g]) * scale[e, n, g] (FP8: e4m3(code) *
    scale), g = k // group_size, as QWeight per expert."""

    kind: Kind
    codes: torch.Tensor  # (E, N, K) uint8
    scale: torch.Tensor  # (E, N, G) float32
    zero: torch.Tensor | None  # (E, N, G) float32; None for FP8
    group_size: int

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, k = self.codes.shape
        return e, n, k

    @property
    def device(self) -> torch.device:
        return self.codes.device

    @property
    def nbytes(self) -> int:
        ts = (self.codes, self.scale, self.zero)
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def expert(self, e: int) -> QWeight:
        return QWeight(self.kind, self.codes[e], self.scale[e],
                       None if self.zero is None else self.zero[e], self.group_size)

    def dequantize(self) -> torch.Tensor:
        """(E, N, K) float32: the weights these stand for (tests and references only)."""
        return torch.stack([self.expert(e).dequantize() for e in range(self.shape[0])])


def stack_experts(parts: list[QWeight], what: str) -> StackedQWeight:
    """The experts' QWeights of one projection (all one shape) as one stack."""
    first = parts[0]
    for i, p in enumerate(parts):
        if p.perm is not None:
            raise ModelLoadError(f"{what}: act-order (GPTQ desc_act) expert weights are not "
                                 "supported; re-quantize the experts without desc_act")
        if p.kind is not first.kind or p.group_size != first.group_size or \
                p.shape != first.shape:
            raise ModelLoadError(f"{what}: expert {i} is stored as {p.kind.name} with groups "
                                 f"of {p.group_size} and shape {p.shape}, expert 0 as "
                                 f"{first.kind.name}, {first.group_size}, {first.shape}: every "
                                 "expert of a layer must share one quantization scheme")
    zero = None if first.zero is None else torch.stack([p.zero for p in parts  # type: ignore[misc]
                                                        ])
    return StackedQWeight(first.kind, torch.stack([p.codes for p in parts]),
                          torch.stack([p.scale for p in parts]), zero, first.group_size)


def quantize_experts_fp8(stacked: torch.Tensor) -> StackedQWeight:
    """(E, N, K) float experts -> per-(expert, output channel) FP8: `--quantization fp8`."""
    e, n, k = stacked.shape
    q = quantize_fp8(stacked.reshape(e * n, k))
    return StackedQWeight(Kind.FP8, q.codes.view(e, n, k), q.scale.view(e, n, -1), None,
                          q.group_size)


def quantize_experts_int(stacked: torch.Tensor, bits: int, group_size: int,
                         symmetric: bool = True) -> StackedQWeight:
    """(E, N, K) float experts -> round-to-nearest int4 / int8 per group of inputs (what
    benches and tests write; checkpoints bring their own codes)."""
    e = stacked.shape[0]
    return stack_experts([quantize_int(stacked[i], bits, group_size, symmetric)
                          for i in range(e)], "experts")


@dataclass(frozen=True)
class PackedExperts:
    """One projection of every expert in the CPU kernel's layout (csrc/quant_gemm.h), stacked:
    codes (E, NB, Kp / 2 or K, 16) uint8, scale and zero (E, NB, G, 16) float32 (zero empty
    for FP8). `halves`: gate_up, its gate and up blocks padded to 16 channels apart."""

    kind: Kind
    n: int  # output channels per expert (2F for gate_up)
    k: int
    group_size: int
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.zero))


def pack_experts_for_cpu(w: StackedQWeight, halves: bool) -> PackedExperts:
    """`w` in the CPU kernel's layout, packed expert by expert at load (cpu_kernel.pack_for_cpu:
    the dense GEMM's own packing, so the MoE op reads the blocks its helpers read)."""
    num, n, k = w.shape
    parts = 2 if halves else 1
    rows = n // parts
    if halves and n % 2:
        raise ModelLoadError(f"gate_up of {n} rows: not a gate and an up of equal width")
    codes, scale, zero = [], [], []
    for e in range(num):
        q = w.expert(e)
        for h in range(parts):
            p = pack_for_cpu(q.rows(slice(h * rows, (h + 1) * rows)))
            codes.append(p.codes)
            scale.append(p.scale)
            zero.append(p.zero)
    nb = -(-rows // BLOCK) * parts  # blocks per expert

    def stack(ts: list[torch.Tensor]) -> torch.Tensor:
        if ts[0].numel() == 0:
            return torch.empty(0)
        return torch.cat(ts).view(num, nb, *ts[0].shape[1:]).contiguous()

    return PackedExperts(w.kind, n, k, w.group_size, stack(codes), stack(scale), stack(zero))
