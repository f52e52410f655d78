"""Sliding-window models end to end: greedy fp32 tokens equal HF transformers' `generate` for
a tiny Mistral (every layer windowed) and a tiny Qwen2 (sliding and full layers mixed) whose
window is shorter than the prompts: with the radix cache cold and warm (prefix hits longer
than the window), prefill chunks of 16 crossing the window's edge, on the native CPU kernels,
the torch path, and the Triton backend under the interpreter (and on a GPU, with CUDA
graphs: a `gpu` test)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from radixserve import LLM
from radixserve.model.families.registry import read_model_spec
from radixserve.model_source import ModelLoadError
from radixserve.types import SamplingParams
from tests.model.test_parity import hf_greedy, random_prompts
from tests.tiny_models import make_tiny_model

WINDOW = 12
LENGTHS = [5, 13, 40, 90]  # below, at and past the window; 90: the varlen (long chunk) path
NEW = 10


@pytest.fixture(scope="module")
def tiny_mistral_swa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("mistral_swa"), "mistral",
                           sliding_window=WINDOW, num_kv_heads=1)


@pytest.fixture(scope="module")
def tiny_qwen2_swa(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("qwen2_swa"), "qwen2",
                           sliding_window=WINDOW)


def run_twice(model_dir: Path, prompts: list[list[int]], **kw: object) -> list[list[list[int]]]:
    """Tokens of the same prompts run twice through one engine (the second time from the
    radix cache: each prompt's cached prefix reaches past the window)."""
    llm = LLM(model=str(model_dir), dtype="float32", kv_cache_tokens=4096, **kw)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    waves = []
    for wave in range(2):
        res = llm.generate(prompts, params)
        if wave and not kw.get("disable_radix_cache"):
            assert all(r.num_cached_tokens >= min(len(p) - 1, 16) for r, p in
                       zip(res, prompts, strict=True) if len(p) > WINDOW)
        waves.append([r.token_ids for r in res])
    llm.engine.check_integrity()
    return waves


def test_arch_reads_each_layers_window(tiny_mistral_swa: Path, tiny_qwen2_swa: Path,
                                       tiny_qwen2: Path, tmp_path: Path) -> None:
    assert read_model_spec(tiny_mistral_swa).layer_windows == (WINDOW, WINDOW)
    # Qwen2: use_sliding_window with max_window_layers=1: layer 0 full, layer 1 sliding
    assert read_model_spec(tiny_qwen2_swa).layer_windows == (None, WINDOW)
    # Qwen2's sliding_window without use_sliding_window is off, as in transformers
    assert read_model_spec(tiny_qwen2).layer_windows == ()
    cfg = json.loads((tiny_mistral_swa / "config.json").read_text())
    for bad in (0, "12"):
        (tmp_path / "config.json").write_text(json.dumps({**cfg, "sliding_window": bad}))
        with pytest.raises(ModelLoadError, match="sliding_window must be a positive integer"):
            read_model_spec(tmp_path)


@pytest.mark.parametrize("fixture", ["tiny_mistral_swa", "tiny_qwen2_swa"])
@pytest.mark.parametrize(("kernels", "kw"), [
    ("native", {"chunked_prefill_size": 16}),
    ("native", {}),
    ("torch", {"chunked_prefill_size": 16}),
    ("native", {"disable_radix_cache": True}),
])
def test_window_models_match_hf(fixture: str, kernels: str, kw: dict[str, object],
                                request: pytest.FixtureRequest,
                                monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = request.getfixturevalue(fixture)
    if kernels == "torch":
        monkeypatch.setenv("RADIXSERVE_NO_CPU_KERNELS", "1")
    prompts = random_prompts(LENGTHS, 250, seed=4)
    ref = hf_greedy(model_dir, prompts, NEW)
    cold, warm = run_twice(model_dir, prompts, **kw)
    assert cold == ref
    assert warm == ref


@pytest.mark.slow  # the whole model under Triton's interpreter: ~20 s on 2 cores
def test_window_model_on_triton_matches_hf(tiny_mistral_swa: Path) -> None:
    prompts = random_prompts([30, 7], 250, seed=5)
    ref = hf_greedy(tiny_mistral_swa, prompts, 6)
    llm = LLM(model=str(tiny_mistral_swa), dtype="float32", kv_cache_tokens=1024,
              attention_backend="triton", chunked_prefill_size=16)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for _ in range(2):  # cold, then from the radix cache
        assert [r.token_ids for r in llm.generate(prompts, params)] == ref


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_window_model_with_cuda_graphs_matches_hf(tiny_mistral_swa: Path,
                                                  tiny_qwen2_swa: Path) -> None:
    """On a GPU: the fused Triton forward with decode steps replayed from CUDA graphs (each
    layer's window compiled into its kernels), cold and from the radix cache."""
    for model_dir in (tiny_mistral_swa, tiny_qwen2_swa):
        prompts = random_prompts(LENGTHS, 250, seed=6)
        ref = hf_greedy(model_dir, prompts, NEW)
        waves = run_twice(model_dir, prompts, device="cuda", cuda_graph_max_bs=8,
                          chunked_prefill_size=16)
        assert waves == [ref, ref]
        llm = LLM(model=str(model_dir), dtype="float32", device="cuda", kv_cache_tokens=4096,
                  cuda_graph_max_bs=8)
        graphs = llm.engine.runner.graphs
        assert graphs is not None
        params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
        assert [r.token_ids for r in llm.generate(prompts, params)] == ref
        assert sum(graphs.num_steps.values()) > 0
