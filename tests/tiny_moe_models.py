"""Tiny random mixture-of-experts models saved as HF folders, in either expert layout.

Owns: building them for tests with transformers' own config and model classes. The
"per_expert" layout is what `save_pretrained` writes (transformers 5 converts its packed
experts back on save); "packed" saves the model's in-memory state dict as is
(`experts.gate_up_proj` (E, 2F, hidden), `experts.down_proj` (E, hidden, F)).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
import transformers
from safetensors.torch import save_file
from transformers import PreTrainedModel

from tests.tiny_models import make_tokenizer

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")
Layout = Literal["per_expert", "packed"]


def _config(family: str, common: dict[str, Any], num_experts: int, top_k: int,
            sparse: dict[str, Any], width: int = 32) -> Any:
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**common, num_experts=num_experts,
                                           num_experts_per_tok=top_k,
                                           moe_intermediate_size=width,
                                           norm_topk_prob=True, head_dim=16, **sparse)
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**common, num_experts=num_experts,
                                           num_experts_per_tok=top_k,
                                           moe_intermediate_size=width,
                                           shared_expert_intermediate_size=48,
                                           norm_topk_prob=False, **sparse)
    if family == "mixtral":
        common = {**common, "intermediate_size": width}
        return transformers.MixtralConfig(**common, num_local_experts=num_experts,
                                          num_experts_per_tok=top_k, sliding_window=None)
    if family == "olmoe":
        common = {**common, "intermediate_size": width}
        return transformers.OlmoeConfig(**common, num_experts=num_experts,
                                        num_experts_per_tok=top_k, norm_topk_prob=False)
    raise ValueError(f"unknown MoE family {family}")


def build_tiny_moe(family: str, *, num_experts: int = 8, top_k: int = 2, num_layers: int = 2,
                   hidden_size: int = 64, seed: int = 0,
                   sparse: dict[str, Any] | None = None, expert_size: int = 32
                   ) -> PreTrainedModel:
    """A random HF model of `family` (FAMILIES) in fp32. `sparse`: the Qwens'
    decoder_sparse_step / mlp_only_layers; `expert_size`: each expert's intermediate width."""
    tokenizer = make_tokenizer()
    common = {
        "vocab_size": len(tokenizer), "hidden_size": hidden_size, "intermediate_size": 96,
        "num_hidden_layers": num_layers, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 1024, "tie_word_embeddings": False,
        # No EOS in the config: the parity tests' HF generate runs with min_new_tokens, which
        # would mask the EOS logit where our ignore_eos keeps it (a tiny random model picks
        # <|im_end|> now and then); the engine takes its EOS from the tokenizer.
        "eos_token_id": None, "bos_token_id": None,
        "pad_token_id": tokenizer.pad_token_id, "rms_norm_eps": 1e-6,
    }
    cfg = _config(family, common, num_experts, top_k, sparse or {}, expert_size)
    torch.manual_seed(seed)
    model: PreTrainedModel = _model_class(family)(cfg)
    with torch.no_grad():
        for p in model.parameters():
            # Larger than the init default so that greedy outputs vary with the input.
            p.normal_(0.0, 0.15)
    model.config.dtype = torch.float32
    return model


def _model_class(family: str) -> Any:
    return {"qwen3_moe": transformers.Qwen3MoeForCausalLM,
            "qwen2_moe": transformers.Qwen2MoeForCausalLM,
            "mixtral": transformers.MixtralForCausalLM,
            "olmoe": transformers.OlmoeForCausalLM}[family]


def save_tiny_moe(model: PreTrainedModel, path: Path, layout: Layout = "per_expert") -> Path:
    """`model` as an HF folder (with the tests' tokenizer) in `layout`."""
    path.mkdir(parents=True, exist_ok=True)
    if layout == "per_expert":
        model.save_pretrained(path, safe_serialization=True)
    else:
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(path)
        tensors = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    make_tokenizer().save_pretrained(path)
    return path


def make_tiny_moe(path: Path, family: str, layout: Layout = "per_expert",
                  **kw: Any) -> Path:
    return save_tiny_moe(build_tiny_moe(family, **kw), path, layout)
