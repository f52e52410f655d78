"""The family registry and config parsing: architectures and model_types to families, the
refusal of an unknown one, transformers 4 and 5 config forms, and every rope scaling's tables
against transformers' own ROPE_INIT_FUNCTIONS."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from radixserve.model.arch import FULL, SLIDING, rope_spec
from radixserve.model.families.gemma import GemmaArch
from radixserve.model.families.registry import FAMILIES, parse_config, supported_architectures
from radixserve.model.rope import RotaryTable, inv_frequencies
from radixserve.model_source import ModelLoadError

BASE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def test_unknown_architecture_names_the_supported_list() -> None:
    with pytest.raises(ModelLoadError) as err:
        parse_config({**BASE, "architectures": ["FalconForCausalLM"]})
    msg = str(err.value)
    assert "unsupported architecture 'FalconForCausalLM'; supported: " in msg
    for arch in ("LlamaForCausalLM", "Qwen3ForCausalLM", "Gemma2ForCausalLM",
                 "Gemma3ForCausalLM", "Phi3ForCausalLM", "MistralForCausalLM"):
        assert arch in msg


def test_model_type_alone_finds_the_family() -> None:
    for family in FAMILIES:
        for model_type in family.model_types:
            spec = parse_config({**BASE, "model_type": model_type})
            assert spec.architecture == family.architectures[0]
    assert len(set(supported_architectures())) == len(supported_architectures())


def test_sliding_windows_as_each_family_configures_them() -> None:
    mistral = parse_config({**BASE, "architectures": ["MistralForCausalLM"],
                            "sliding_window": 16})
    assert [mistral.window(i) for i in range(4)] == [16] * 4
    qwen2_off = parse_config({**BASE, "architectures": ["Qwen2ForCausalLM"],
                              "sliding_window": 16, "use_sliding_window": False})
    assert qwen2_off.sliding_window is None and qwen2_off.qkv_bias
    qwen2 = parse_config({**BASE, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 16,
                          "use_sliding_window": True, "max_window_layers": 2})
    assert [qwen2.window(i) for i in range(4)] == [None, None, 16, 16]
    gemma2 = parse_config({**BASE, "architectures": ["Gemma2ForCausalLM"],
                           "sliding_window": 16})  # transformers 4: no layer_types
    assert [gemma2.window(i) for i in range(4)] == [16, None, 16, None]


def test_gemma3_transformers_4_config() -> None:
    """rope_local_base_freq and sliding_window_pattern (every 2nd layer global here)."""
    spec = parse_config({**BASE, "architectures": ["Gemma3ForCausalLM"], "sliding_window": 8,
                         "sliding_window_pattern": 2, "rope_theta": 1e6,
                         "rope_local_base_freq": 1e4, "query_pre_attn_scalar": 16,
                         "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert isinstance(spec, GemmaArch) and spec.qk_norm and spec.tie_word_embeddings
    assert spec.layer_types == (SLIDING, FULL, SLIDING, FULL)
    assert spec.rope.theta == 1e6 and spec.rope.kind == "linear" and spec.rope.factor == 8.0
    assert spec.local_rope is not None and spec.local_rope.theta == 1e4
    assert spec.local_rope.kind == "default"
    assert spec.head_dim == 256 and spec.hidden_act == "gelu_tanh"


def test_unsupported_rope_and_layer_types_are_refused() -> None:
    with pytest.raises(ModelLoadError, match="unsupported rope scaling 'dynamic'"):
        parse_config({**BASE, "architectures": ["LlamaForCausalLM"],
                      "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    with pytest.raises(ModelLoadError, match="unsupported layer_types"):
        parse_config({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 4,
                      "layer_types": ["chunked_attention"] * 4})


def hf_inv_freq(config: Any, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    config.standardize_rope_params()
    kind = config.rope_parameters["rope_type"]
    inv, scale = ROPE_INIT_FUNCTIONS[kind](config, None, seq_len=seq_len)
    return inv, float(scale)


@pytest.mark.parametrize("params", [
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
     "mscale": 1.0, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
     "attention_factor": 1.3, "truncate": False},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 64},
    {"rope_type": "linear", "factor": 3.0},
])
def test_rope_scalings_equal_transformers(params: dict[str, Any]) -> None:
    cfg = LlamaConfig(**BASE, max_position_embeddings=512,
                      rope_parameters={**params, "rope_theta": 5e5})
    want_inv, want_scale = hf_inv_freq(cfg)
    spec = rope_spec(cfg.to_dict())
    torch.testing.assert_close(inv_frequencies(spec, 16), want_inv.float(), rtol=0, atol=0)
    table = RotaryTable(spec, 16, 32, torch.float32, torch.device("cpu"))
    freqs = torch.outer(torch.arange(32).float(), want_inv.float())
    emb = torch.cat([freqs, freqs], -1)
    torch.testing.assert_close(table.cos, emb.cos() * want_scale, rtol=0, atol=0)


def test_longrope_short_below_and_long_from_original_max() -> None:
    """Phi-3's LongRoPE with partial rotary: positions below original_max_position_embeddings
    get HF's short-factor table, positions at or past it HF's long one; both scaled alike."""
    rope = {"rope_type": "longrope", "short_factor": [1.0, 1.5, 2.0, 4.0],
            "long_factor": [2.0, 3.0, 5.0, 9.0], "rope_theta": 1e4}
    cfg = Phi3Config(**BASE, max_position_embeddings=256, original_max_position_embeddings=64,
                     partial_rotary_factor=0.5, rope_parameters=rope)
    cfg_dict = cfg.to_dict()
    spec = rope_spec(cfg_dict)
    assert spec.partial_rotary_factor == 0.5 and spec.original_max_position == 64
    short, scale = hf_inv_freq(cfg)
    long, _ = hf_inv_freq(cfg, seq_len=65)
    table = RotaryTable(spec, 16, 128, torch.float32, torch.device("cpu"))
    assert table.rotary_dim == 8 and table.partial
    pos = torch.arange(128).float()
    want = torch.cat([torch.outer(pos[:64], short), torch.outer(pos[64:], long)])
    torch.testing.assert_close(table.cos, torch.cat([want, want], -1).cos() * scale,
                               rtol=0, atol=0)
    assert scale > 1.0
