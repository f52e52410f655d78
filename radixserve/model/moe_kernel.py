"""The native CPU experts of a mixture-of-experts layer: loading the op, and when it runs.

Owns: loading csrc/moe/moe_experts.cpp's op `moe_experts` (and csrc/moe/moe_quant.cpp's
`moe_experts_quant`, the quantized experts': load_moe_experts_quant) at the process's CPU
tier (platform/kernels.py's MOE_EXPERTS, built per tier) and `MoEExpertsOp`, its signature:

    moe_experts(x (T, D), topk_weights (T, k), topk_ids (T, k) int64,
                gate_up (E, 2F, D), down (E, D, F), first_expert,
                gate_up_scale (E, 2F) = None, down_scale (E, D) = None) -> (T, D)

the weighted sum over each token's top-k experts among the local ones [first_expert,
first_expert + E) of down_e(silu(gate_e(x)) * up_e(x)), in ascending expert order as HF sums
them; x float32 or bfloat16, the stacked weights in x's dtype, or int8 codes with fp32
per-(expert, output channel) scales (W = code * scale: `quantize_experts`); fp32
accumulation. One call per layer: the grouping is inside (a counting sort), so no count is
read on the host.
`native_fits` says where it is the faster path (everywhere but a bf16 prefill on a tier
without AVX512-BF16, which goes to oneDNN).
Does not know: routing, the shared expert, parallelism (layers/moe.py), or its specification,
which is layers/moe.py's torch path (`grouped_experts`), kept where the op does not build
(no compiler), with RADIXSERVE_NO_CPU_KERNELS=1, and on CUDA.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixserve.model.quant import quantize_per_channel
from radixserve.platform.cpu_isa import CpuIsa
from radixserve.platform.kernels import ENV_DISABLE, MOE_EXPERTS, load_extension

__all__ = ["ENV_DISABLE"]

# (x, topk_weights, topk_ids, gate_up, down, first_expert[, gate_up_scale, down_scale])
MoEExpertsOp = Callable[..., torch.Tensor]

NATIVE_DTYPES = (torch.float32, torch.bfloat16)
# bf16 below AVX512-BF16 (the op widens bf16 weights for fp32 FMAs): above this many rows per
# expert on average (prefill), oneDNN's bf16 GEMMs on the stacked weights are faster. With
# vdpbf16ps the op is as fast as oneDNN at 128 rows per expert and faster below, and fp32
# runs the op at every size (bench/README.md, "Mixture of experts on CPU").
WIDENED_BF16_MAX_ROWS_PER_EXPERT = 8


def native_fits(tokens: int, top_k: int, num_experts: int, dtype: torch.dtype,
                bf16_dot: bool) -> bool:
    """Whether the op is the faster path for `tokens` rows, from the shapes alone (the mean
    rows per expert), so the choice reads nothing on the host. `bf16_dot`: the op's tier
    multiplies bf16 with vdpbf16ps (bf16_dot_products)."""
    if dtype != torch.bfloat16 or bf16_dot:
        return True
    return tokens * top_k <= WIDENED_BF16_MAX_ROWS_PER_EXPERT * num_experts


def bf16_dot_products() -> bool:
    """Whether the op as loaded runs bf16 layers on vdpbf16ps (its tier is avx512_bf16 or
    above)."""
    loaded = load_extension(MOE_EXPERTS)
    return loaded is not None and loaded.tier.rank >= CpuIsa.AVX512_BF16.rank


def load_moe_experts(device: torch.device, dtype: torch.dtype) -> MoEExpertsOp | None:
    """The op at the process's tier for CPU weights of `dtype` (built on first use, once per
    process and tier); None where it does not apply or build (the torch path runs)."""
    if device.type != "cpu" or dtype not in NATIVE_DTYPES:
        return None
    loaded = load_extension(MOE_EXPERTS)
    if loaded is None:
        return None
    op: MoEExpertsOp = loaded.op("moe_experts")
    return op


def quantize_experts(stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(E, N, K) float -> int8 codes (E, N, K) and fp32 scales (E, N): symmetric, one scale per
    expert and output channel (quant.py's per-channel rule, expert by expert)."""
    e, n, k = stacked.shape
    q = quantize_per_channel(stacked.reshape(e * n, k))
    return q.qweight.view(e, n, k), q.scale.view(e, n)


def load_moe_experts_quant(device: torch.device) -> MoEExpertsOp | None:
    """csrc/moe/moe_quant.cpp's op on quantized experts at the process's tier (x float32 or
    bfloat16):

        moe_experts_quant(x, topk_weights, topk_ids, gu_codes, gu_scale, gu_zero, gu_kind,
                          gu_group, dn_codes, dn_scale, dn_zero, dn_kind, dn_group, inter,
                          first_expert) -> (T, D)

    on quantization/experts.py's PackedExperts; None where it does not apply or build."""
    if device.type != "cpu":
        return None
    loaded = load_extension(MOE_EXPERTS)
    if loaded is None:
        return None
    op: MoEExpertsOp = loaded.op("moe_experts_quant")
    return op
