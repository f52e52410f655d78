"""Tiny random models of every family beyond Llama's, in odd shapes, built with transformers'
own config classes and saved as real HF folders (safetensors + tests/tiny_models' tokenizer).

Owns: the shapes the family tests run (head_dim not hidden / heads, one KV head, sliding
windows shorter than the prompts, sliding and global layers mixed, soft-capping on, partial
rotary, yarn / longrope / linear scaling). Does not know: the engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    MistralConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from tests.tiny_models import make_tokenizer

WINDOW = 8  # shorter than every multi-token prompt of the tests


def _common(**kw: Any) -> dict[str, Any]:
    tok = make_tokenizer()
    base = {"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
            "max_position_embeddings": 512, "eos_token_id": tok.eos_token_id,
            "bos_token_id": None, "pad_token_id": tok.pad_token_id, "rms_norm_eps": 1e-6}
    return {**base, **kw}


def _configs() -> dict[str, PretrainedConfig]:
    yarn = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 32,
            "rope_theta": 10000.0}
    gemma3_rope = {"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                   "full_attention": {"rope_type": "linear", "factor": 2.0,
                                      "rope_theta": 1000000.0}}
    longrope = {"rope_type": "longrope", "rope_theta": 10000.0,
                "short_factor": [1.0, 1.3, 2.0, 3.5], "long_factor": [1.5, 2.5, 4.0, 8.0]}
    return {
        # head_dim 32 != 64 / 4; one KV head; tied embeddings; yarn scaling
        "qwen3": Qwen3Config(**_common(num_key_value_heads=1, head_dim=32,
                                       tie_word_embeddings=True, rope_parameters=yarn)),
        # sliding on the layers >= max_window_layers only
        "qwen3_swa": Qwen3Config(**_common(head_dim=32, use_sliding_window=True,
                                           sliding_window=WINDOW, max_window_layers=1)),
        "qwen2_swa": Qwen2Config(**_common(use_sliding_window=True, sliding_window=WINDOW,
                                           max_window_layers=1)),
        "mistral_swa": MistralConfig(**_common(sliding_window=WINDOW, head_dim=32)),
        # alternating sliding/global layers, both soft-caps on, query_pre_attn_scalar
        "gemma2": Gemma2Config(**_common(head_dim=32, sliding_window=WINDOW,
                                         query_pre_attn_scalar=24, attn_logit_softcapping=1.5,
                                         final_logit_softcapping=3.0)),
        # local/global rope bases (global linear-scaled), QK-norm, one KV head
        "gemma3": Gemma3TextConfig(**_common(num_key_value_heads=1, head_dim=32,
                                             sliding_window=WINDOW, query_pre_attn_scalar=32,
                                             layer_types=["sliding_attention", "full_attention",
                                                          "sliding_attention"],
                                             rope_parameters=gemma3_rope)),
        # fused qkv_proj / gate_up_proj, half the head rotated, LongRoPE short factors
        "phi3": Phi3Config(**_common(partial_rotary_factor=0.5, rope_parameters=longrope,
                                     original_max_position_embeddings=128, head_dim=16,
                                     tie_word_embeddings=False)),
    }


CASES = tuple(_configs())


def make_family_model(path: Path, case: str, seed: int = 0) -> Path:
    """Save the tiny model of `case` (one of CASES) with the tests' tokenizer."""
    config = _configs()[case]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            # Larger than the init default so that greedy outputs vary with the input.
            p.normal_(0.0, 0.15)
    model.config.dtype = torch.float32
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer().save_pretrained(path)
    return path
