"""OLMoE: Llama's layer order with a QK-norm over the whole q and k projections (one RMSNorm
across all heads, before the split into heads and RoPE; optionally q, k and v clamped to
clip_qkv first) and a top-k MoE block on every layer (norm_topk_prob false in its releases).

Owns: OlmoeLayer and OLMoE's config fields. Does not know: kernels (layers/).
NOTE: the whole-projection norm spans every head, which tensor parallelism splits over the
ranks: TP is refused for OLMoE (a load error) rather than computed per rank wrongly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from radixserve.model.arch import common_fields
from radixserve.model.families.base import DecoderLayer, ModelParts
from radixserve.model.families.family import Family, Features
from radixserve.model.families.llama import LlamaLayer
from radixserve.model.families.moe import sparse_mlp
from radixserve.model.layers.context import ForwardContext
from radixserve.model.layers.moe_spec import MoEArch, read_moe_spec
from radixserve.model.layers.norm import Residual, RMSNorm
from radixserve.model.weights import ModelWeights, WeightNames
from radixserve.model_source import ModelLoadError


class OlmoeLayer(LlamaLayer):
    """Llama's layer, q and k normalized over their whole projections before attention."""

    def __init__(self, base: LlamaLayer, qk_norm: tuple[RMSNorm, RMSNorm],
                 clip: float | None) -> None:
        super().__init__(base.index, base.input_norm, base.qkv, base.attn, base.o_proj,
                         base.post_norm, base.mlp)
        self.qk_norm, self.clip = qk_norm, clip

    def forward(self, ctx: ForwardContext, stream: Residual) -> None:
        check = self.index == 0
        qkv = self.qkv(self.input_norm.of(stream, check))  # (T, q + 2 kv)
        if self.clip is not None:
            qkv = qkv.clamp(-self.clip, self.clip)
        s = self.attn.shape
        q_norm, k_norm = self.qk_norm
        qkv = torch.cat([q_norm(qkv[:, : s.q_size]),  # (T, q) over all heads at once
                         k_norm(qkv[:, s.q_size : s.q_size + s.kv_size]),
                         qkv[:, s.q_size + s.kv_size :]], dim=1)
        self.o_proj.into(stream, self.attn(ctx, qkv))
        self.mlp.into(ctx, stream, self.post_norm.of(stream, check))


def olmoe_layers(parts: ModelParts, weights: ModelWeights) -> Sequence[DecoderLayer]:
    if parts.tp is not None:
        raise ModelLoadError("OLMoE's QK-norm spans every attention head: tensor parallelism "
                             "is not supported for OlmoeForCausalLM (use "
                             "--tensor-parallel-size 1)")
    s = parts.spec
    assert isinstance(s, MoEArch)
    layers = []
    for i, lw in enumerate(weights.layers):
        base = LlamaLayer(i, parts.norm(lw.input_norm), parts.qkv(i, lw),
                          parts.attention(i, s.rope), parts.o_proj(i, lw),
                          parts.norm(lw.post_norm), sparse_mlp(parts, lw))
        qk = (parts.norm(lw.extra["self_attn.q_norm"]), parts.norm(lw.extra["self_attn.k_norm"]))
        layers.append(OlmoeLayer(base, qk, s.clip_qkv))
    return layers


def parse_olmoe(arch: str, cfg: dict[str, Any]) -> MoEArch:
    clip = cfg.get("clip_qkv")
    return MoEArch(**common_fields(arch, cfg), moe=read_moe_spec(arch, cfg),
                   clip_qkv=float(clip) if clip is not None else None)


OLMOE = Family("olmoe", ("OlmoeForCausalLM",), ("olmoe",), parse_olmoe, olmoe_layers,
               WeightNames(extra=("self_attn.q_norm", "self_attn.k_norm")),
               features=Features(tensor_parallel=False))
