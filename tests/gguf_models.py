"""Tiny GGUF files of the families beyond Llama's, written from tiny random HF models with the
`gguf` package's GGUFWriter as llama.cpp's convert_hf_to_gguf.py writes them (Llama's own
GGUF path is served by the default SmolLM2's): its metadata
keys, its tensor names (gguf's own HF -> GGUF name map, the one transformers' reader inverts),
Gemma's norms stored as `1 + w`, a byte-level ("gpt2") vocabulary, fp32 tensors (exact).

Owns: the GGUF layout of each case in CASES and the shapes chosen so that what transformers'
reader does not read back (it leaves those keys to the config class's defaults) is the
default already: Qwen3's head_dim 128, Gemma 2's soft-caps and query_pre_attn_scalar, Gemma
3's rope bases and layer pattern, Phi-3 without partial rotary or LongRoPE.
Does not know: the engine, what a test checks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from transformers import (
    AutoModelForCausalLM,
    Gemma2Config,
    Gemma3TextConfig,
    Phi3Config,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from tests.tiny_models import SPECIALS, make_tokenizer

# case -> llama.cpp's architecture name
ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3",
        "phi3": "phi3"}
CASES = tuple(ARCH)
_CONTROL, _NORMAL = 3, 1  # llama.cpp's token types


def _config(case: str) -> PretrainedConfig:
    tok = make_tokenizer()
    common: dict[str, Any] = {
        "vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "eos_token_id": tok.eos_token_id, "bos_token_id": None,
        "pad_token_id": tok.pad_token_id, "rms_norm_eps": 1e-6}
    if case == "qwen3":  # the reader keeps Qwen3Config's head_dim (128), as real Qwen3s have
        return Qwen3Config(**{**common, "num_attention_heads": 2, "num_key_value_heads": 1},
                           head_dim=128, tie_word_embeddings=True)
    if case == "qwen2":
        return Qwen2Config(**common, tie_word_embeddings=False)
    if case == "gemma2":  # sliding and global layers alternate; window shorter than prompts
        return Gemma2Config(**{**common, "num_key_value_heads": 1}, head_dim=32,
                            sliding_window=8)
    if case == "gemma3":  # five sliding layers, then a global one (the default pattern)
        return Gemma3TextConfig(**{**common, "num_hidden_layers": 6, "num_key_value_heads": 1},
                                head_dim=32, sliding_window=8)
    if case == "phi3":  # fused qkv_proj / gate_up_proj
        return Phi3Config(**common, tie_word_embeddings=False)
    raise ValueError(f"unknown case {case}")


def make_hf_model(path: Path, case: str, seed: int = 0) -> Path:
    """The tiny random HF folder a case's GGUF is written from."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(_config(case), dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)  # larger than the init default: outputs vary with the input
    model.config.dtype = torch.float32
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer().save_pretrained(path)
    return path


def _metadata(w: gguf.GGUFWriter, case: str, cfg: PretrainedConfig) -> None:
    w.add_name(f"tiny-{case}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(cfg.rope_parameters.get("rope_theta")
                               or cfg.rope_parameters["full_attention"]["rope_theta"]))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(cfg.vocab_size)
    if case.startswith("gemma"):
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(cfg.sliding_window)
    tok = make_tokenizer()
    tokens = tok.convert_ids_to_tokens(list(range(len(tok))))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([_CONTROL if t in SPECIALS else _NORMAL for t in tokens])
    w.add_token_scores([0.0] * len(tokens))  # no merges: one token per byte
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)


def write_gguf(hf_dir: Path, out: Path, case: str) -> Path:
    """`hf_dir`'s model (make_hf_model's `case`) as one fp32 GGUF file at `out`."""
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    cfg = model.config
    arch = ARCH[case]
    names = gguf.get_tensor_name_map(
        next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch), cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(out), arch)
    _metadata(w, case, cfg)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp writes no output.weight for tied embeddings
        base, suffix = hf_name.rsplit(".", 1)
        name = names.get_name(base)
        assert name is not None, hf_name
        if case.startswith("gemma") and name.endswith("norm"):
            t = t + 1.0  # llama.cpp folds Gemma's (1 + w) into the stored norm
        w.add_tensor(f"{name}.{suffix}", np.ascontiguousarray(t.numpy(), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
