"""Greedy outputs of our forward equal HF transformers' own generate (fp32), token for token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from radixserve import LLM
from radixserve.types import SamplingParams
from tests.tiny_models import make_tiny_model


def hf_greedy(model_dir: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    outs = []
    for p in prompts:
        seq = hf.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones(1, len(p), dtype=torch.long))
        outs.append(seq[0, len(p):].tolist())
    return outs


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def check_parity(model_dir: Path, lengths: list[int], n: int, vocab: int, **kw: object) -> None:
    prompts = random_prompts(lengths, vocab)
    # Different max_tokens per prompt: requests finish at different steps of one batch.
    params = [SamplingParams(temperature=0, max_tokens=n - (i % 3), ignore_eos=True)
              for i in range(len(prompts))]
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_tokens=8192, **kw)
    ours = llm.generate(prompts, params)
    ref = hf_greedy(model_dir, prompts, n)
    for i, (o, r) in enumerate(zip(ours, ref, strict=True)):
        assert o.token_ids == r[: n - (i % 3)], f"prompt {i} (len {lengths[i]})"
    llm.engine.check_integrity()
    assert llm.kv_stats()["kv_held_tokens"] == 0


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_llama_tied", "tiny_qwen2"])
def test_tiny_models_match_hf(fixture: str, request: pytest.FixtureRequest) -> None:
    # 600: a prefill attended in query chunks (attention/varlen.py's CAUSAL_CHUNK)
    check_parity(request.getfixturevalue(fixture), [1, 7, 33, 64, 130, 5, 600], 16, 250)


def test_tiny_model_page_size_4_matches_hf(tiny_llama: Path) -> None:
    check_parity(tiny_llama, [3, 9, 40, 66], 12, 250, page_size=4)


def test_mistral_and_llama3_rope(tmp_path: Path) -> None:
    mistral = make_tiny_model(tmp_path / "mistral", "mistral")
    check_parity(mistral, [4, 50, 20], 10, 250)
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    llama3 = make_tiny_model(tmp_path / "llama3", "llama", rope_scaling=rope)
    check_parity(llama3, [4, 150, 20], 10, 250)


@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_matches_hf() -> None:
    """The default model: 9 prompts of different lengths (520: query chunks), 32 new tokens."""
    from radixserve.model_source import resolve_model

    hf_dir = resolve_model("smollm2-135m").hf_dir
    check_parity(hf_dir, [3, 12, 25, 47, 80, 111, 160, 230, 520], 32, 49152)
