"""MoESpec: the mixture-of-experts shape of a model, read from its HF config.json.

Owns: MoEArch (ModelArch plus the MoESpec), which config keys each MoE family names its expert count, top-k, expert width and
shared expert by, the router's renormalisation rule per family, and which decoder layers are
sparse (`decoder_sparse_step`, `mlp_only_layers`). Does not know: tensors, the forward.

Families (transformers' own modeling files):
- Qwen3-MoE: `num_experts`, `num_experts_per_tok`, `moe_intermediate_size`, `norm_topk_prob`,
  `decoder_sparse_step`, `mlp_only_layers` (those layers are dense, `intermediate_size` wide);
- Qwen2-MoE: as Qwen3-MoE plus a shared expert (`shared_expert_intermediate_size`) scaled by
  sigmoid(x @ shared_expert_gate);
- Mixtral: `num_local_experts` (transformers 5 writes that key for every family), `num_experts_per_tok`, experts `intermediate_size` wide, the
  top-k weights always renormalised (MixtralTopKRouter: softmax, top-k, divide by the sum);
- OLMoE: `num_experts`, experts `intermediate_size` wide, `norm_topk_prob` (false in OLMoE's
  checkpoints), every layer sparse.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from radixserve.model.arch import ModelArch
from radixserve.model_source import ModelLoadError

MOE_ARCHS = ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM",
             "OlmoeForCausalLM")


@dataclass(frozen=True)
class MoESpec:
    num_experts: int
    top_k: int  # experts per token
    expert_size: int  # each expert's intermediate width
    renormalize: bool  # the top-k weights divided by their sum (norm_topk_prob)
    shared_expert_size: int = 0  # Qwen2-MoE's shared expert width; 0: none
    sparse_step: int = 1  # decoder_sparse_step: layer i is sparse when (i + 1) % step == 0
    mlp_only_layers: tuple[int, ...] = ()  # dense layers among sparse ones

    def __post_init__(self) -> None:
        if self.num_experts < 1:
            raise ModelLoadError(f"num_experts must be at least 1, got {self.num_experts}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ModelLoadError(f"num_experts_per_tok {self.top_k} must be in "
                                 f"[1, num_experts={self.num_experts}]")
        if self.expert_size < 1 or self.shared_expert_size < 0:
            raise ModelLoadError(f"bad expert sizes {self.expert_size}, "
                                 f"{self.shared_expert_size}")
        if self.sparse_step < 1:
            raise ModelLoadError(f"decoder_sparse_step must be >= 1, got {self.sparse_step}")

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` has the MoE block (else a dense gated MLP)."""
        return layer not in self.mlp_only_layers and (layer + 1) % self.sparse_step == 0

    def sparse_layers(self, num_layers: int) -> list[int]:
        return [i for i in range(num_layers) if self.is_sparse(i)]


@dataclass(frozen=True)
class MoEArch(ModelArch):
    """A MoE family's ModelArch: the experts' shape beside the dense fields (whose
    `intermediate_size` is the dense layers' width: Qwen-MoE's mlp_only_layers)."""

    moe: MoESpec | None = None
    clip_qkv: float | None = None  # OLMoE: q, k, v clamped to [-clip, clip]


def moe_of(spec: ModelArch) -> MoESpec | None:
    """The model's MoESpec (None: a dense model)."""
    return spec.moe if isinstance(spec, MoEArch) else None


def moe_info(spec: ModelArch, tp_size: int = 1, expert_parallel: bool = False
             ) -> dict[str, Any] | None:
    """What /server_info lists of a MoE model (None for a dense one)."""
    moe = moe_of(spec)
    if moe is None:
        return None
    ep = expert_parallel and tp_size > 1
    return {"num_experts": moe.num_experts, "top_k": moe.top_k,
            "expert_intermediate_size": moe.expert_size,
            "shared_expert_intermediate_size": moe.shared_expert_size,
            "renormalize_top_k": moe.renormalize,
            "num_sparse_layers": len(moe.sparse_layers(spec.num_layers)),
            "expert_parallel": ep,
            "experts_per_rank": moe.num_experts // tp_size if ep else moe.num_experts}


# transformers' config-class defaults for a key config.json leaves out (as HF loads it):
# (experts, top-k, expert width, shared expert width); None: the dense intermediate_size.
_HF_DEFAULTS: dict[str, tuple[int, int, int | None, int]] = {
    "Qwen3MoeForCausalLM": (128, 8, 768, 0),
    "Qwen2MoeForCausalLM": (60, 4, 1408, 5632),
    "MixtralForCausalLM": (8, 2, None, 0),
    "OlmoeForCausalLM": (64, 8, None, 0),
}


def _num_experts(cfg: Mapping[str, Any], default: int) -> int:
    # transformers 5 writes num_local_experts for every family (an attribute_map alias);
    # the Qwen and OLMoE checkpoints on the hub write num_experts.
    for key in ("num_experts", "num_local_experts"):
        if cfg.get(key) is not None:
            return int(cfg[key])
    return default


def read_moe_spec(architecture: str, cfg: Mapping[str, Any]) -> MoESpec:
    """The MoESpec of one of MOE_ARCHS from its config.json (a key it leaves out takes
    transformers' default, as HF's config class fills it in); ModelLoadError names a bad
    value."""
    if architecture not in MOE_ARCHS:
        raise ModelLoadError(f"{architecture} is not a mixture-of-experts architecture")
    experts, top_k, width, shared = _HF_DEFAULTS[architecture]
    try:
        num, k = _num_experts(cfg, experts), int(cfg.get("num_experts_per_tok") or top_k)
        if width is None:  # Mixtral, OLMoE: the experts are intermediate_size wide
            return MoESpec(num, k, expert_size=int(cfg["intermediate_size"]),
                           renormalize=architecture == "MixtralForCausalLM"
                           or bool(cfg.get("norm_topk_prob", False)))
        if architecture == "Qwen2MoeForCausalLM":
            shared = int(cfg.get("shared_expert_intermediate_size", shared))
        return MoESpec(
            num, k,
            expert_size=int(cfg.get("moe_intermediate_size") or width),
            renormalize=bool(cfg.get("norm_topk_prob", False)),
            shared_expert_size=shared,
            sparse_step=int(cfg.get("decoder_sparse_step") or 1),
            mlp_only_layers=tuple(int(i) for i in cfg.get("mlp_only_layers") or ()),
        )
    except KeyError as err:
        raise ModelLoadError(f"{architecture} config.json lacks {err.args[0]!r}") from None
