"""Qwen3 (dense): Llama's layer with a per-head RMSNorm on q and k before RoPE, head_dim from
the config (not hidden / heads), no qkv bias, tied embeddings on the small sizes.

Owns: Qwen3's config fields. Does not know: kernels (layers/), the layer order (llama.py).
"""

from __future__ import annotations

from typing import Any

from radixserve.model.arch import ModelArch, common_fields
from radixserve.model.families.family import Family, Features
from radixserve.model.families.llama import llama_layers, qwen2_window
from radixserve.model.weights import WeightNames


def parse_qwen3(arch: str, cfg: dict[str, Any]) -> ModelArch:
    fields = common_fields(arch, cfg)
    window, types = qwen2_window(cfg, fields["num_layers"])
    return ModelArch(**fields, sliding_window=window, layer_types=types, qk_norm=True)


QWEN3 = Family("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), parse_qwen3, llama_layers,
               WeightNames(extra=("self_attn.q_norm", "self_attn.k_norm")),
               features=Features(sliding_window=True, gguf="tested"))
