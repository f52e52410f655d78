"""What the mixture-of-experts families share: the sparse feed-forward slot and the layers.

Owns: SparseMoE (the FeedForward slot over layers/moe.py's MoEBlock: the residual add, and
under tensor or expert parallelism the one all-reduce of the ranks' partial sums, rank 0
alone adding the residual) and moe_layers (Llama's decoder layer with the MoE block on the
sparse layers and the dense gated MLP on the others: Qwen-MoE's mlp_only_layers and
decoder_sparse_step), and which experts a linear method gives: float, int8
(--quantization int8), or quantized (a quantized checkpoint's, or --quantization fp8's
per-channel FP8: layers/moe_quant.py). Does not know: any family's config keys (qwen_moe.py, mixtral.py,
olmoe.py), the expert kernels (layers/moe.py, triton_kernels/fused_moe.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from radixserve.model.families.base import DecoderLayer, ModelParts
from radixserve.model.families.llama import llama_layer
from radixserve.model.layers.context import ForwardContext
from radixserve.model.layers.linear import FloatMethod, Int8Method
from radixserve.model.layers.moe import MoEBlock, MoEWeights
from radixserve.model.layers.moe_quant import QuantExperts, QuantSharedExpert
from radixserve.model.layers.moe_spec import moe_of
from radixserve.model.layers.norm import Residual
from radixserve.model.quantization.experts import StackedQWeight, quantize_experts_fp8
from radixserve.model.quantization.methods import CheckpointMethod, Fp8Method
from radixserve.model.weights import LayerWeights, ModelWeights
from radixserve.model_source import ModelLoadError

if TYPE_CHECKING:
    from radixserve.parallel.comm import TPComm


class SparseMoE:
    """stream += MoE(x): the experts' weighted sum (+ the gated shared expert)."""

    def __init__(self, block: MoEBlock, tp: TPComm | None) -> None:
        self.block, self.tp = block, tp

    @property
    def nbytes(self) -> int:
        return self.block.nbytes

    def into(self, ctx: ForwardContext, stream: Residual, x: torch.Tensor) -> None:
        if stream.fused:  # the next norm adds it, fused
            stream.add(self(ctx, x))
            return
        if self.tp is None:
            stream.h = self.block(x, stream.h)  # (T, hidden): residual + experts, HF's order
            return
        # Rank 0 alone adds the residual, so the all-reduced sum is the new residual.
        part = self.block(x, stream.h if self.tp.is_lead else None)
        stream.h = self.tp.all_reduce(part)

    def __call__(self, ctx: ForwardContext, x: torch.Tensor) -> torch.Tensor:
        out = self.block(x, None, ctx.fused)  # (T, hidden): this rank's partial sum
        return out if self.tp is None else self.tp.all_reduce(out)


def _quant_experts(parts: ModelParts, weights: MoEWeights) -> QuantExperts | None:
    """The layer's quantized experts: a quantized checkpoint's, or --quantization fp8's
    per-channel FP8 of float ones; None where they stay float."""
    moe = moe_of(parts.spec)
    assert moe is not None
    gate_up, down = weights.gate_up, weights.down
    if isinstance(parts.method, Fp8Method) and isinstance(gate_up, torch.Tensor):
        assert isinstance(down, torch.Tensor)
        gate_up, down = quantize_experts_fp8(gate_up), quantize_experts_fp8(down)
    if not isinstance(gate_up, StackedQWeight):
        return None
    assert isinstance(down, StackedQWeight)
    return QuantExperts(gate_up, down, moe.num_experts, weights.first_expert, parts.fused,
                        device=parts.device)


def sparse_mlp(parts: ModelParts, lw: LayerWeights) -> SparseMoE:
    moe = moe_of(parts.spec)
    assert moe is not None and lw.moe is not None
    int8 = isinstance(parts.method, Int8Method)
    if not isinstance(parts.method, (FloatMethod, Int8Method, Fp8Method, CheckpointMethod)):
        raise ModelLoadError(f"{parts.method.name} quantization does not cover a "
                             "mixture-of-experts model's experts: serve it in its dtype, "
                             "with --quantization int8 or fp8, or from a quantized checkpoint")
    # On CPU the native MoE op (int8 and quantized experts too), else oneDNN-prepacked
    # experts; the fused (CUDA) path runs the stacked weights (quantized: dequantized in the
    # Triton kernel).
    quant = _quant_experts(parts, lw.moe)
    block = MoEBlock(moe, lw.moe, prepacked=not parts.fused, int8=int8, quant=quant,
                     shared=_quant_shared(parts, lw.moe))
    return SparseMoE(block, parts.tp)


def _quant_shared(parts: ModelParts, weights: MoEWeights) -> QuantSharedExpert | None:
    """Qwen2-MoE's shared expert where quantized: a checkpoint's QWeights, or float weights
    under --quantization fp8 (per-channel FP8, as vLLM quantizes it); None: float."""
    gate_up, down = weights.shared_gate_up, weights.shared_down
    if gate_up is None or down is None:
        return None
    quantized = isinstance(gate_up, list) or isinstance(parts.method, Fp8Method)
    if not quantized:
        return None
    return QuantSharedExpert(parts.method.create(gate_up, None),
                             parts.method.create(down, None))


def moe_layers(parts: ModelParts, weights: ModelWeights) -> Sequence[DecoderLayer]:
    """Llama's layer order; the MoE block where the layer is sparse, else the dense MLP."""
    return [llama_layer(parts, i, lw, sparse_mlp(parts, lw) if lw.moe is not None else None)
            for i, lw in enumerate(weights.layers)]
