"""Mixtral: Mistral's attention (an optional sliding window) with a top-k MoE block on every
layer, the top-k weights always renormalised (`block_sparse_moe.experts.{i}.w1/w3/w2` in its
checkpoints, `mlp.experts.gate_up_proj` in transformers 5's packed layout).

Owns: Mixtral's config fields. Does not know: kernels (layers/), the layer order (moe.py).
"""

from __future__ import annotations

from typing import Any

from radixserve.model.arch import common_fields, layer_types
from radixserve.model.families.family import Family, Features
from radixserve.model.families.moe import moe_layers
from radixserve.model.layers.moe_spec import MoEArch, read_moe_spec


def parse_mixtral(arch: str, cfg: dict[str, Any]) -> MoEArch:
    fields = common_fields(arch, cfg)
    window = cfg.get("sliding_window")
    return MoEArch(**fields, sliding_window=int(window) if window else None,
                   layer_types=layer_types(cfg, fields["num_layers"]) if window else (),
                   moe=read_moe_spec(arch, cfg))


MIXTRAL = Family("mixtral", ("MixtralForCausalLM",), ("mixtral",), parse_mixtral, moe_layers,
                 features=Features(sliding_window=True))
