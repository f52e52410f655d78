"""Fixtures of the LoRA tests: a tiny Llama, three PEFT adapters and their merged models."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.lora_adapters import ATTN, MLP, make_merged_model, make_peft_adapter
from tests.model.test_parity import hf_greedy, random_prompts
from tests.tiny_models import make_tiny_model

NUM_NEW = 8


@dataclass(frozen=True)
class LoRASet:
    base: Path
    adapters: dict[str, Path]  # name -> PEFT folder
    prompts: list[list[int]]
    # HF transformers' greedy tokens per model: None (the base) or an adapter's merged model
    refs: dict[str | None, list[list[int]]]


@pytest.fixture(scope="session")
def lora_set(tmp_path_factory: pytest.TempPathFactory) -> LoRASet:
    tmp = tmp_path_factory.mktemp("lora")
    base = make_tiny_model(tmp / "base", "llama")
    adapters = {
        "alpha": make_peft_adapter(tmp / "alpha", base, ATTN + MLP, r=4, alpha=8, seed=1,
                                   std=0.1),
        "beta": make_peft_adapter(tmp / "beta", base, ("q_proj", "v_proj"), r=8, alpha=16,
                                  seed=2, use_rslora=True),
        "gamma": make_peft_adapter(tmp / "gamma", base, ("o_proj", "down_proj", "up_proj"),
                                   r=2, alpha=4, seed=3),
    }
    prompts = random_prompts([5, 17, 9, 30, 12, 3, 21, 8], 250, seed=7)
    refs: dict[str | None, list[list[int]]] = {None: hf_greedy(base, prompts, NUM_NEW)}
    for name, folder in adapters.items():
        merged = make_merged_model(base, folder, tmp / f"merged-{name}")
        refs[name] = hf_greedy(merged, prompts, NUM_NEW)
    for name in adapters:  # the adapters change the output (else the test could not fail)
        assert refs[name] != refs[None], name
    return LoRASet(base, adapters, prompts, refs)
