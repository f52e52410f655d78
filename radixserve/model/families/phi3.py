"""Phi-3 / Phi-4 / Phi-4-mini: Llama's layer over a checkpoint that stores q, k, v as one
`qkv_proj` and gate, up as one `gate_up_proj`, with partial rotary (Phi-4-mini: 0.75 of each
head) and LongRoPE's short and long factors.

Owns: Phi-3's config fields and checkpoint names. Does not know: kernels (layers/), the
layer order (llama.py), how LongRoPE's tables are built (rope.py).
"""

from __future__ import annotations

from typing import Any

from radixserve.model.arch import ModelArch, common_fields, layer_types, sliding_window
from radixserve.model.families.family import Family, Features
from radixserve.model.families.llama import llama_layers
from radixserve.model.weights import WeightNames


def parse_phi3(arch: str, cfg: dict[str, Any]) -> ModelArch:
    fields = common_fields(arch, cfg)
    window = sliding_window(cfg)
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        from radixserve.model_source import ModelLoadError

        raise ModelLoadError(f"Phi-3 with hidden_act {act!r}: only silu is supported")
    return ModelArch(**fields, sliding_window=window,
                     layer_types=layer_types(cfg, fields["num_layers"]) if window else ())


PHI3 = Family("phi3", ("Phi3ForCausalLM",), ("phi3",), parse_phi3, llama_layers,
              WeightNames(fused_qkv="self_attn.qkv_proj", fused_gate_up="mlp.gate_up_proj"),
              features=Features(sliding_window=True, gguf="tested"))
