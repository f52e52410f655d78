"""Parsing an HF config.json into the frozen ModelArch the forward pass needs.

Owns: architecture and rope-scaling validation. Does not know: weights, tensors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from radixserve.model_source import ModelLoadError

SUPPORTED_ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    kind: str = "default"  # one of SUPPORTED_ROPE
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class ModelArch:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeSpec
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    eos_token_id: int | list[int] | None
    # Per layer: its sliding window (HF's sliding_window), or None for full causal attention;
    # () for a model without windows.
    layer_windows: tuple[int | None, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ModelLoadError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )


def _rope_spec(cfg: dict[str, Any]) -> RopeSpec:
    # transformers 5 writes rope_parameters (with rope_theta inside); 4.x writes rope_scaling.
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in SUPPORTED_ROPE:
        raise ModelLoadError(
            f"unsupported rope scaling {kind!r}; supported: {', '.join(SUPPORTED_ROPE)}"
        )
    return RopeSpec(
        theta=theta,
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )


def read_model_spec(hf_dir: Path) -> ModelArch:
    cfg = json.loads((hf_dir / "config.json").read_text())
    archs = cfg.get("architectures") or []
    arch = archs[0] if archs else {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                   "mistral": "MistralForCausalLM"}.get(cfg.get("model_type", ""))
    if arch not in SUPPORTED_ARCHS:
        raise ModelLoadError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHS)}"
        )
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    return ModelArch(
        architecture=arch,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or hidden // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=_rope_spec(cfg),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or bool(cfg.get("attention_bias", False)),
        eos_token_id=cfg.get("eos_token_id"),
        layer_windows=_layer_windows(cfg, arch),
    )


def _layer_windows(cfg: dict[str, Any], arch: str) -> tuple[int | None, ...]:
    """Each layer's sliding window as transformers sets it: Mistral's on every layer; Qwen2's
    only with use_sliding_window, on the layers `layer_types` marks (else those from
    max_window_layers on)."""
    window = cfg.get("sliding_window")
    if arch == "Qwen2ForCausalLM" and not cfg.get("use_sliding_window", False):
        window = None
    layers = int(cfg["num_hidden_layers"])
    if window is None:
        return ()
    if not isinstance(window, int) or window < 1:
        raise ModelLoadError(f"sliding_window must be a positive integer, got {window!r}")
    if arch != "Qwen2ForCausalLM":
        return (window,) * layers
    types = cfg.get("layer_types") or [
        "sliding_attention" if i >= int(cfg.get("max_window_layers", 28)) else "full_attention"
        for i in range(layers)]
    if len(types) != layers:
        raise ModelLoadError(f"layer_types has {len(types)} entries for {layers} layers")
    return tuple(window if t == "sliding_attention" else None for t in types)
