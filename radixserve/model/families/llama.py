"""Llama and the families that share its decoder layer: Llama, Mistral, Qwen2 (qkv bias).

Owns: LlamaLayer (pre-norm attention and SwiGLU MLP, each added to the residual; with QK-norm
for Qwen3, partial rotary for Phi-3: the flags are the arch's) and those families' configs
(Mistral's and Qwen2's sliding window: Qwen2's only with use_sliding_window, from
max_window_layers up as HF's layer_types says). Does not know: kernels (layers/).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from radixserve.model.arch import (
    FULL,
    SLIDING,
    ModelArch,
    common_fields,
    layer_types,
    sliding_window,
)
from radixserve.model.families.base import DecoderLayer, ModelParts
from radixserve.model.families.family import Family, Features
from radixserve.model.layers.attention import Attention
from radixserve.model.layers.context import ForwardContext
from radixserve.model.layers.linear import LinearLayer, RowParallelLinear
from radixserve.model.layers.mlp import FeedForward
from radixserve.model.layers.norm import Residual, RMSNorm
from radixserve.model.weights import LayerWeights, ModelWeights


class LlamaLayer:
    """x = norm(h); h += o_proj(attn(qkv(x))); h += mlp(norm(h))."""

    def __init__(self, index: int, input_norm: RMSNorm, qkv: LinearLayer, attn: Attention,
                 o_proj: RowParallelLinear, post_norm: RMSNorm, mlp: FeedForward) -> None:
        self.index, self.input_norm, self.qkv, self.attn = index, input_norm, qkv, attn
        self.o_proj, self.post_norm, self.mlp = o_proj, post_norm, mlp

    @property
    def nbytes(self) -> int:
        return self.qkv.nbytes + self.o_proj.nbytes + self.mlp.nbytes

    def forward(self, ctx: ForwardContext, stream: Residual) -> None:
        check = self.index == 0  # the fused kernels' argument checks: layer 0 only
        x = self.input_norm.of(stream, check)  # (T, hidden)
        self.o_proj.into(stream, self.attn(ctx, self.qkv(x)))
        self.mlp.into(ctx, stream, self.post_norm.of(stream, check))


def llama_layer(parts: ModelParts, i: int, lw: LayerWeights, mlp: FeedForward | None = None
                ) -> LlamaLayer:
    """`mlp`: the feed-forward slot where it is not the dense gated MLP (a MoE block)."""
    s = parts.spec
    qk = None
    if s.qk_norm:
        qk = (parts.norm(lw.extra["self_attn.q_norm"]), parts.norm(lw.extra["self_attn.k_norm"]))
    attn = parts.attention(i, s.rope, window=s.window(i), qk_norm=qk)
    return LlamaLayer(i, parts.norm(lw.input_norm), parts.qkv(i, lw), attn, parts.o_proj(i, lw),
                      parts.norm(lw.post_norm), mlp or parts.mlp(i, lw, s.hidden_act))


def llama_layers(parts: ModelParts, weights: ModelWeights) -> Sequence[DecoderLayer]:
    return [llama_layer(parts, i, lw) for i, lw in enumerate(weights.layers)]


def qwen2_window(cfg: dict[str, Any], num_layers: int
                 ) -> tuple[int | None, tuple[str, ...]]:
    """Qwen2/Qwen3: a window only with use_sliding_window, on layers >= max_window_layers."""
    if not cfg.get("use_sliding_window", False):
        return None, ()
    window = sliding_window(cfg)
    if window is None:
        return None, ()
    types = layer_types(cfg, num_layers)
    if not types:
        first = int(cfg.get("max_window_layers", num_layers))
        types = tuple(SLIDING if i >= first else FULL for i in range(num_layers))
    return window, types


def parse_llama(arch: str, cfg: dict[str, Any]) -> ModelArch:
    fields = common_fields(arch, cfg)
    if arch == "Qwen2ForCausalLM":
        fields["qkv_bias"] = True
        window, types = qwen2_window(cfg, fields["num_layers"])
        return ModelArch(**fields, sliding_window=window, layer_types=types)
    window = sliding_window(cfg) if arch == "MistralForCausalLM" else None
    return ModelArch(**fields, sliding_window=window,
                     layer_types=layer_types(cfg, fields["num_layers"]) if window else ())


LLAMA = Family("llama", ("LlamaForCausalLM",), ("llama",), parse_llama, llama_layers,
               features=Features(gguf="tested"))
MISTRAL = Family("mistral", ("MistralForCausalLM",), ("mistral",), parse_llama, llama_layers,
                 features=Features(sliding_window=True))
QWEN2 = Family("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), parse_llama, llama_layers,
               features=Features(sliding_window=True, gguf="tested"))
