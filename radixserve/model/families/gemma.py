"""Gemma 2 and Gemma 3 (text): four norms per layer, `(1 + w)` RMSNorm, embeddings scaled by
sqrt(hidden), GELU-tanh, query_pre_attn_scalar, sliding and global layers (Gemma 3: its own
rope base on sliding layers), attention and final logit soft-capping (Gemma 2), QK-norm
(Gemma 3). `Gemma3ForConditionalGeneration` (how Gemma 3 4B/12B/27B ship: a `text_config`
and a vision tower) is served text-only, as vLLM does when no image is sent: its language
model, read from `text_config` with transformers' defaults for what that leaves out; the
vision weights are never read (weights.py finds the language model's under its prefixes).

Owns: GemmaLayer's order and the Gemma config fields (GemmaArch). Does not know: kernels
(layers/), checkpoint layout beyond the names below, images (the API refuses them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.model.arch import (
    FULL,
    SLIDING,
    ModelArch,
    RopeSpec,
    common_fields,
    layer_types,
    rope_params,
    rope_spec,
    sliding_window,
)
from radixserve.model.families.base import DecoderLayer, ModelParts
from radixserve.model.families.family import Family, Features, HeadOptions
from radixserve.model.layers.attention import Attention
from radixserve.model.layers.context import ForwardContext
from radixserve.model.layers.linear import LinearLayer, RowParallelLinear
from radixserve.model.layers.mlp import FeedForward
from radixserve.model.layers.norm import Residual, RMSNorm
from radixserve.model.weights import ModelWeights, WeightNames
from radixserve.model_source import ModelLoadError

MULTIMODAL_GEMMA3 = "Gemma3ForConditionalGeneration"
GEMMA3 = ("Gemma3ForCausalLM", MULTIMODAL_GEMMA3)
_ACTS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu": "gelu_tanh"}


@dataclass(frozen=True)
class GemmaArch(ModelArch):
    query_pre_attn_scalar: float = 256.0
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    local_rope: RopeSpec | None = None  # Gemma 3's sliding layers' rope (None: `rope`)


class GemmaLayer:
    """h += post_attn_norm(attn(norm(h))); h += post_ff_norm(mlp(pre_ff_norm(h)))."""

    def __init__(self, index: int, norms: tuple[RMSNorm, RMSNorm, RMSNorm, RMSNorm],
                 qkv: LinearLayer, attn: Attention, o_proj: RowParallelLinear,
                 mlp: FeedForward) -> None:
        self.index, self.norms, self.qkv, self.attn = index, norms, qkv, attn
        self.o_proj, self.mlp = o_proj, mlp

    @property
    def nbytes(self) -> int:
        return self.qkv.nbytes + self.o_proj.nbytes + self.mlp.nbytes

    def forward(self, ctx: ForwardContext, stream: Residual) -> None:
        pre_attn, post_attn, pre_ff, post_ff = self.norms
        check = self.index == 0
        x = pre_attn.of(stream, check)  # (T, hidden)
        stream.add(post_attn(self.o_proj.reduced(self.attn(ctx, self.qkv(x)))))
        x = pre_ff.of(stream, check)
        stream.add(post_ff(self.mlp(ctx, x)))


NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm")


def gemma_layers(parts: ModelParts, weights: ModelWeights) -> Sequence[DecoderLayer]:
    spec = parts.spec
    assert isinstance(spec, GemmaArch)
    out = []
    for i, lw in enumerate(weights.layers):
        window = spec.window(i)
        rope = spec.local_rope if window is not None and spec.local_rope else spec.rope
        qk = None
        if spec.qk_norm:
            qk = (parts.norm(lw.extra["self_attn.q_norm"], gemma=True),
                  parts.norm(lw.extra["self_attn.k_norm"], gemma=True))
        attn = parts.attention(i, rope, spec.query_pre_attn_scalar**-0.5, window,
                               spec.attn_logit_softcap, qk)
        norms = (parts.norm(lw.input_norm, True), parts.norm(lw.post_norm, True),
                 parts.norm(lw.extra[NORMS[0]], True), parts.norm(lw.extra[NORMS[1]], True))
        out.append(GemmaLayer(i, norms, parts.qkv(i, lw), attn, parts.o_proj(i, lw),
                              parts.mlp(i, lw, spec.hidden_act)))
    return out


def _gemma_types(arch: str, cfg: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    types = layer_types(cfg, num_layers)
    if types:
        return types
    if arch in GEMMA3:  # every pattern-th layer global
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern")
                      or 6)
        return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))
    return tuple(FULL if i % 2 else SLIDING for i in range(num_layers))  # Gemma 2


def text_model_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """A multimodal Gemma 3's language model config, as transformers loads it: `text_config`
    with Gemma3TextConfig's defaults for what it leaves out (a released config.json states
    only a few keys there), and the model's EOS ids and embedding tying, which the top level
    states for the whole model."""
    from transformers import Gemma3TextConfig

    text = cfg.get("text_config")
    if not isinstance(text, dict):
        raise ModelLoadError(f"{MULTIMODAL_GEMMA3} config.json has no text_config object")
    given = {k: v for k, v in text.items() if k not in ("model_type", "architectures")}
    out: dict[str, Any] = Gemma3TextConfig(**given).to_dict()
    for key in ("eos_token_id", "tie_word_embeddings"):
        if cfg.get(key) is not None:
            out[key] = cfg[key]
    return out


def parse_gemma(arch: str, cfg: dict[str, Any]) -> ModelArch:
    if arch == MULTIMODAL_GEMMA3:
        cfg = text_model_config(cfg)
    cfg = {**cfg, "head_dim": cfg.get("head_dim") or 256}
    fields = common_fields(arch, cfg)
    fields["tie_word_embeddings"] = bool(cfg.get("tie_word_embeddings", True))
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in _ACTS:
        raise ModelLoadError(f"Gemma with hidden_activation {act!r}: supported: {list(_ACTS)}")
    window = sliding_window(cfg)
    types = _gemma_types(arch, cfg, fields["num_layers"]) if window else ()
    local = None
    if arch in GEMMA3:
        local_params = rope_params(cfg, SLIDING)
        if SLIDING in (cfg.get("rope_parameters") or {}):  # transformers 5: nested per type
            local = rope_spec(cfg, local_params)
            fields["rope"] = rope_spec(cfg, rope_params(cfg, FULL))
        else:  # transformers 4: rope_local_base_freq, unscaled
            local = RopeSpec(theta=float(cfg.get("rope_local_base_freq", 10000.0)))
    return GemmaArch(
        **fields, sliding_window=window, layer_types=types,
        qk_norm=arch in GEMMA3, hidden_act=_ACTS[act],
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar") or fields["head_dim"]),
        attn_logit_softcap=cfg.get("attn_logit_softcapping"),
        final_logit_softcap=cfg.get("final_logit_softcapping"), local_rope=local)


def _embed_scale(spec: ModelArch) -> float:
    return math.sqrt(spec.hidden_size)


def _final_softcap(spec: ModelArch) -> float | None:
    return spec.final_logit_softcap if isinstance(spec, GemmaArch) else None


_HEAD = HeadOptions(embed_scale=_embed_scale, final_softcap=_final_softcap,
                    gemma_final_norm=True)
GEMMA2 = Family("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), parse_gemma, gemma_layers,
                WeightNames(extra=NORMS), _HEAD, Features(sliding_window=True, gguf="tested"))
GEMMA3_FAMILY = Family("gemma3", GEMMA3, ("gemma3_text",), parse_gemma, gemma_layers,
                       WeightNames(extra=(*NORMS, "self_attn.q_norm", "self_attn.k_norm")),
                       _HEAD, Features(sliding_window=True, gguf="tested"))
