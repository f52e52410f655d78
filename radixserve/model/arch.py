"""The frozen model description every family shares, and the config.json parsing helpers.

Owns: ModelArch (the fields the engine reads: sizes, heads, the KV layout, per-layer
attention kinds), RopeSpec and the parsing of rope parameters (transformers 4's
`rope_scaling` and 5's `rope_parameters`, flat or per layer type). Does not know: which
architectures exist (families/registry.py) or any family's own fields (each family's module
parses those into its own frozen subclass), weights, tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.model_source import ModelLoadError

SUPPORTED_ROPE = ("default", "linear", "llama3", "yarn", "longrope")
SLIDING = "sliding_attention"
FULL = "full_attention"


@dataclass(frozen=True)
class RopeSpec:
    theta: float
    kind: str = "default"  # one of SUPPORTED_ROPE
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    partial_rotary_factor: float = 1.0  # the rotated share of head_dim (Phi-4-mini: 0.75)
    attention_factor: float | None = None  # yarn/longrope: cos/sin scale (None: derived)
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors
    long_factor: tuple[float, ...] = ()
    max_position: int = 0  # longrope/yarn: the model's max_position_embeddings


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
    sliding_window: int | None = None  # tokens a sliding layer attends to (None: no layer)
    layer_types: tuple[str, ...] = ()  # SLIDING / FULL per layer; () = all FULL
    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3)
    hidden_act: str = "silu"  # the gated MLP's: "silu" or "gelu_tanh"

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads != 0:
            raise ModelLoadError(
                f"num_attention_heads {self.num_heads} is not a multiple of "
                f"num_key_value_heads {self.num_kv_heads}"
            )
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ModelLoadError(f"layer_types has {len(self.layer_types)} entries for "
                                 f"{self.num_layers} layers")

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        """Each layer's sliding window (None: full causal); () for a model without windows."""
        if self.sliding_window is None:
            return ()
        return tuple(self.window(i) for i in range(self.num_layers))

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer` (None: it attends to the whole context)."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[layer] != SLIDING:
            return None
        return self.sliding_window


def rope_params(cfg: dict[str, Any], layer_type: str | None = None) -> dict[str, Any]:
    """The rope parameters as one flat dict (transformers 5 nests them per layer type)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if layer_type is not None and isinstance(params.get(layer_type), dict):
        return dict(params[layer_type])
    if isinstance(params.get(FULL), dict):  # nested, and no layer type asked: the global one
        return dict(params[FULL])
    return params


def rope_spec(cfg: dict[str, Any], params: dict[str, Any] | None = None,
              theta: float | None = None) -> RopeSpec:
    """RopeSpec from the config (`params`: a layer type's own, else the flat ones)."""
    params = rope_params(cfg) if params is None else params
    if theta is None:
        theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind == "su":  # Phi-3's early name for longrope
        kind = "longrope"
    if kind not in SUPPORTED_ROPE:
        raise ModelLoadError(
            f"unsupported rope scaling {kind!r}; supported: {', '.join(SUPPORTED_ROPE)}"
        )
    max_pos = int(cfg.get("max_position_embeddings", 4096))
    # Phi-3 keeps original_max_position_embeddings beside the rope dict; it wins there (HF).
    original = cfg.get("original_max_position_embeddings") if kind == "longrope" else None
    original = original or params.get("original_max_position_embeddings")
    if original is None:
        original = 8192 if kind == "llama3" else max_pos
    factor = params.get("factor")
    if factor is None:
        factor = max_pos / original if kind in ("yarn", "longrope") else 1.0
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))

    def floats(key: str) -> tuple[float, ...]:
        return tuple(float(x) for x in params.get(key) or ())

    def opt(key: str) -> float | None:
        return None if params.get(key) is None else float(params[key])

    return RopeSpec(
        theta=theta, kind=kind, factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(original), partial_rotary_factor=float(partial or 1.0),
        attention_factor=opt("attention_factor"),
        beta_fast=float(params.get("beta_fast") or 32), beta_slow=float(params.get("beta_slow")
                                                                       or 1),
        mscale=opt("mscale"), mscale_all_dim=opt("mscale_all_dim"),
        truncate=bool(params.get("truncate", True)), short_factor=floats("short_factor"),
        long_factor=floats("long_factor"), max_position=max_pos)


def common_fields(arch: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The ModelArch fields every decoder-only family reads the same way."""
    num_heads = int(cfg["num_attention_heads"])
    hidden = int(cfg["hidden_size"])
    return {
        "architecture": arch,
        "vocab_size": int(cfg["vocab_size"]),
        "hidden_size": hidden,
        "intermediate_size": int(cfg["intermediate_size"]),
        "num_layers": int(cfg["num_hidden_layers"]),
        "num_heads": num_heads,
        "num_kv_heads": int(cfg.get("num_key_value_heads") or num_heads),
        "head_dim": int(cfg.get("head_dim") or hidden // num_heads),
        "rms_norm_eps": float(cfg.get("rms_norm_eps", 1e-6)),
        "rope": rope_spec(cfg),
        "max_position_embeddings": int(cfg.get("max_position_embeddings", 4096)),
        "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", False)),
        "qkv_bias": bool(cfg.get("attention_bias", False)),
        "eos_token_id": cfg.get("eos_token_id"),
    }


def sliding_window(cfg: dict[str, Any]) -> int | None:
    """The config's sliding_window (None: absent or null), refused unless a positive int."""
    window = cfg.get("sliding_window")
    if window is None:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ModelLoadError(f"sliding_window must be a positive integer, got {window!r}")
    return window


def layer_types(cfg: dict[str, Any], num_layers: int) -> tuple[str, ...]:
    """`layer_types` as the config lists them ((): none listed)."""
    types = tuple(cfg.get("layer_types") or ())
    bad = sorted(set(types) - {SLIDING, FULL})
    if bad:
        raise ModelLoadError(f"unsupported layer_types {bad}; supported: {SLIDING}, {FULL}")
    return types[:num_layers] if types else ()

