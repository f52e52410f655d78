"""Qwen3-MoE and Qwen2-MoE: Qwen's attention (Qwen3: per-head QK-norm; Qwen2: qkv bias) with
a MoE block on the sparse layers (Qwen2-MoE's with its sigmoid-gated shared expert).

Owns: their config fields (the experts' through layers/moe_spec.py). Does not know: kernels
(layers/), the layer order (families/moe.py).
"""

from __future__ import annotations

from typing import Any

from radixserve.model.arch import common_fields
from radixserve.model.families.family import Family, Features
from radixserve.model.families.llama import qwen2_window
from radixserve.model.families.moe import moe_layers
from radixserve.model.layers.moe_spec import MoEArch, read_moe_spec
from radixserve.model.weights import WeightNames


def parse_qwen_moe(arch: str, cfg: dict[str, Any]) -> MoEArch:
    fields = common_fields(arch, cfg)
    window, types = qwen2_window(cfg, fields["num_layers"])
    if arch == "Qwen2MoeForCausalLM":  # transformers 5 names it; older configs: always on
        fields["qkv_bias"] = bool(cfg.get("qkv_bias", True))
    return MoEArch(**fields, sliding_window=window, layer_types=types,
                   qk_norm=arch == "Qwen3MoeForCausalLM", moe=read_moe_spec(arch, cfg))


_FEATURES = Features(sliding_window=True)
QWEN3_MOE = Family("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), parse_qwen_moe,
                   moe_layers, WeightNames(extra=("self_attn.q_norm", "self_attn.k_norm")),
                   features=_FEATURES)
QWEN2_MOE = Family("qwen2_moe", ("Qwen2MoeForCausalLM",), ("qwen2_moe",), parse_qwen_moe,
                   moe_layers, features=_FEATURES)
