"""`Gemma3ForConditionalGeneration` (how Gemma 3 4B/12B/27B ship) served text-only: its
language model's greedy fp32 tokens equal HF's conditional-generation model on text-only
input, with the checkpoint as released and as transformers saves it ("language_model.model.*",
"vision_tower.*") and with the model classes' own names ("model.language_model.*"); the
vision weights are never read. A released
config.json's sparse `text_config` takes Gemma3TextConfig's defaults, as HF loads it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    SiglipVisionConfig,
)

from radixserve import LLM
from radixserve.model.families.gemma import GemmaArch
from radixserve.model.families.registry import family_of, parse_config, read_model_spec
from radixserve.model.weights import load_weights, text_model_name
from tests.model.test_families import engine_tokens, hf_model_greedy
from tests.model.test_parity import random_prompts
from tests.tiny_models import make_tokenizer

LENGTHS = [1, 13, 21]
VOCAB = 250


@pytest.fixture(scope="module")
def multimodal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tok = make_tokenizer()
    text = Gemma3TextConfig(
        vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, sliding_window=8,
        query_pre_attn_scalar=32, max_position_embeddings=512, rms_norm_eps=1e-6,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        eos_token_id=tok.eos_token_id, bos_token_id=None, pad_token_id=tok.pad_token_id)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                num_attention_heads=2, image_size=28, patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=1,
                          image_token_index=len(tok) + 10, boi_token_index=len(tok) + 11,
                          eoi_token_index=len(tok) + 12, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    model = Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)  # larger than the init default: outputs vary with the input
    path = tmp_path_factory.mktemp("gemma3mm") / "m"
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def _hf_text_only(path: Path, prompts: list[list[int]]) -> list[list[int]]:
    hf = Gemma3ForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    return hf_model_greedy(hf, prompts, 6)


def _module_layout(src: Path, dst: Path) -> Path:
    """The same checkpoint with the model classes' own names ("model.language_model.*", a
    top-level lm_head): transformers saves Gemma 3 as released ("language_model.model.*")."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            (dst / f.name).write_bytes(f.read_bytes())
    state = {}
    for f in src.glob("*.safetensors"):
        for k, v in load_file(f).items():
            k = k.replace("language_model.model.", "model.language_model.")
            k = k.replace("language_model.lm_head.", "lm_head.")
            state[k.replace("vision_tower.", "model.vision_tower.", 1)] = v
    save_file(state, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def test_text_only_matches_hf_conditional_generation_in_both_layouts(
        multimodal: Path, tmp_path: Path) -> None:
    keys = {k for f in multimodal.glob("*.safetensors") for k in load_file(f)}
    assert any(k.startswith("language_model.model.") for k in keys)
    assert any(k.startswith("vision_tower.") for k in keys)  # there, never read
    spec = read_model_spec(multimodal)
    assert isinstance(spec, GemmaArch) and spec.architecture == "Gemma3ForConditionalGeneration"
    assert spec.qk_norm and spec.window(0) == 8 and spec.window(1) is None
    prompts = random_prompts(LENGTHS, VOCAB)
    llm = LLM(model=str(multimodal), dtype="float32", kv_cache_tokens=1024)
    assert engine_tokens(llm, prompts) == _hf_text_only(multimodal, prompts)
    # the other layout reads the same tensors (so serves the same tokens)
    names = family_of(spec.architecture).weight_names
    cpu = torch.device("cpu")
    a = load_weights(multimodal, spec, torch.float32, cpu, show_progress=False, names=names)
    b = load_weights(_module_layout(multimodal, tmp_path / "renamed"), spec, torch.float32,
                     cpu, show_progress=False, names=names)
    for x, y in [(a.embed, b.embed), (a.final_norm, b.final_norm), (a.lm_head, b.lm_head),
                 *[(la.qkv, lb.qkv) for la, lb in zip(a.layers, b.layers, strict=True)],
                 *[(la.extra[k], lb.extra[k]) for la, lb in zip(a.layers, b.layers, strict=True)
                   for k in la.extra]]:
        assert torch.equal(x, y)


def test_text_model_names_under_either_prefix() -> None:
    assert text_model_name("model.language_model.layers.0.mlp.up_proj.weight") == \
        "layers.0.mlp.up_proj.weight"
    assert text_model_name("language_model.model.norm.weight") == "norm.weight"
    assert text_model_name("language_model.lm_head.weight") == "lm_head.weight"
    assert text_model_name("model.embed_tokens.weight") == "embed_tokens.weight"
    assert text_model_name("model.vision_tower.x.weight") == "vision_tower.x.weight"


def test_released_sparse_text_config_takes_transformers_defaults() -> None:
    """gemma-3-4b-it's config.json: text_config states six keys; the rest (heads, head_dim,
    vocabulary, rope bases, the 5:1 sliding pattern) are Gemma3TextConfig's defaults."""
    cfg = json.loads(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "eos_token_id": [1, 106], "text_config": {
            "hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
            "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024}, "vision_config": {"model_type": "siglip_vision_model"}}))
    spec = parse_config(cfg)
    assert isinstance(spec, GemmaArch)
    assert (spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size) == \
        (8, 4, 256, 262208)
    assert spec.eos_token_id == [1, 106] and spec.tie_word_embeddings
    assert [spec.window(i) for i in range(6)] == [1024] * 5 + [None]
    assert spec.rope.theta == 1e6 and spec.rope.factor == 8.0
    assert spec.local_rope is not None and spec.local_rope.theta == 10000.0
    assert spec.query_pre_attn_scalar == 256
