"""Tiny random Llama-family models saved as real HF folders (safetensors + tokenizer).

Owns: building them for tests. They exercise the real loading path in well under a second.
The tokenizer is a byte-level BPE with no merges (one token per byte) plus chat specials, and
a ChatML chat template, so chat, streaming and UTF-8 handling are all real.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer() -> PreTrainedTokenizerFast:
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers: untyped
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        bos_token=None,
        unk_token=None,
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_model(
    path: Path,
    arch: str = "llama",
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    tie_word_embeddings: bool = False,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    rope_scaling: dict[str, Any] | None = None,
    vocab_size: int | None = None,
    sliding_window: int | None = None,
) -> Path:
    """Save a random model of `arch` ("llama" | "qwen2" | "mistral") with our tokenizer.
    `vocab_size`: the model's (at least the tokenizer's; the ids past it have no text)."""
    tokenizer = make_tokenizer()
    vocab_size = max(vocab_size or 0, len(tokenizer))
    common = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size * 2,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": None,
        "pad_token_id": tokenizer.pad_token_id,
        "rms_norm_eps": 1e-6,
    }
    torch.manual_seed(seed)
    if arch == "llama":
        if rope_scaling is not None:
            common["rope_scaling"] = rope_scaling
        model: PreTrainedModel = LlamaForCausalLM(LlamaConfig(**common))
    elif arch == "qwen2":
        window: dict[str, Any] = {"use_sliding_window": True, "sliding_window": sliding_window,
                                  "max_window_layers": 1} if sliding_window else {}
        model = Qwen2ForCausalLM(Qwen2Config(**common, **window))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=sliding_window))
    else:
        raise ValueError(f"unknown arch {arch}")
    with torch.no_grad():
        for p in model.parameters():
            # Larger than the init default so that greedy outputs vary with the input.
            p.normal_(0.0, 0.15)
    model.config.dtype = torch.float32
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path
