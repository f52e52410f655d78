"""Greedy fp32 tokens of the MoE families equal HF transformers' own generate, token for token.

Tiny random models built with transformers' config classes: Qwen3-MoE (per-head QK-norm,
renormalised top-k, a dense layer among sparse ones), Qwen2-MoE (shared expert, qkv bias,
decoder_sparse_step 2), Mixtral (top-k renormalised, block_sparse_moe names), OLMoE
(whole-projection QK-norm, top-k not renormalised); both expert layouts; top-k 2, 3 and 8;
the radix cache on and off, chunked prefill of 16, preemption; the fused (Triton) forward
with the fused MoE under the interpreter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from radixserve import LLM, SamplingParams
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.engine.kv_calibration import calibrate
from radixserve.model.families.registry import load_model, read_model_spec
from tests.engine.test_engine_cache import run_checked, shared_prefix_prompts
from tests.model.test_fused_forward import (
    CPU,
    DEVICE,
    assert_paths_agree,
    greedy,
    runnable_kernels,  # noqa: F401  (a fixture)
)
from tests.model.test_parity import check_parity, random_prompts
from tests.model.test_quant import _greedy, _prefix_agreement
from tests.tiny_moe_models import FAMILIES, Layout, make_tiny_moe

SPARSE: dict[str, dict[str, Any]] = {"qwen3_moe": {"mlp_only_layers": [1]},
                                     "qwen2_moe": {"decoder_sparse_step": 2}}


def tiny(tmp_path: Path, family: str, layout: Layout = "per_expert", **kw: Any) -> Path:
    kw.setdefault("sparse", SPARSE.get(family))
    return make_tiny_moe(tmp_path / f"{family}-{layout}", family, layout, **kw)


@pytest.mark.parametrize("layout", ["per_expert", "packed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_moe_families_match_hf(family: str, layout: Layout, tmp_path: Path) -> None:
    check_parity(tiny(tmp_path, family, layout), [1, 7, 33, 64, 5], 10, 250)


@pytest.mark.parametrize(("family", "top_k", "experts"), [("mixtral", 3, 8),
                                                          ("qwen3_moe", 8, 8),
                                                          ("olmoe", 3, 16)])
def test_top_k_3_and_8(family: str, top_k: int, experts: int, tmp_path: Path) -> None:
    model = tiny(tmp_path, family, top_k=top_k, num_experts=experts, num_layers=3)
    check_parity(model, [3, 40, 17], 10, 250)


@pytest.mark.parametrize("family", ["qwen2_moe", "olmoe"])
def test_cache_off_and_chunked_prefill(family: str, tmp_path: Path) -> None:
    model = tiny(tmp_path, family)
    check_parity(model, [9, 50, 33], 8, 250, disable_radix_cache=True)
    check_parity(model, [9, 50, 33], 8, 250, chunked_prefill_size=16)


def test_preemption_and_radix_hits_lose_nothing(tmp_path: Path) -> None:
    model = tiny(tmp_path, "qwen3_moe")
    prompts = shared_prefix_prompts(3, 4, 40, 9, seed=1)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    base = run_checked(LLM(model=str(model), dtype="float32", kv_cache_tokens=8192,
                           disable_radix_cache=True), prompts, params)
    llm = LLM(model=str(model), dtype="float32", kv_cache_tokens=240, max_model_len=128,
              chunked_prefill_size=16, max_prefill_tokens=24)
    assert run_checked(llm, prompts, params) == base
    stats = llm.kv_stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0


def test_int8_experts_agree_with_fp32(tmp_path: Path) -> None:
    """--quantization int8 covers the experts (the native op on int8 codes): a quarter of
    fp32's expert bytes, greedy tokens close to fp32's (the dense int8 test's measure)."""
    model = tiny(tmp_path, "mixtral")
    prompts = [[5 + i, 17, 42 + i, 9] for i in range(6)]
    fp32 = LLM(model=str(model), dtype="float32", kv_cache_tokens=1024)
    ref = _greedy(fp32, prompts, 8)
    int8 = LLM(model=str(model), dtype="float32", kv_cache_tokens=1024, quantization="int8")
    got = _greedy(int8, prompts, 8)
    assert _prefix_agreement(ref, got) >= 0.8
    q_layers, _ = int8.engine.runner.model.linear_weight_bytes()
    f_layers, _ = fp32.engine.runner.model.linear_weight_bytes()
    assert f_layers / 4 < q_layers < f_layers / 3.5


@pytest.mark.usefixtures("runnable_kernels")
@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_fused_forward_with_the_triton_moe(family: str, tmp_path: Path) -> None:
    """The model's fused path (Triton backend: fused_moe under the interpreter on CPU; a
    shared expert, a dense layer) gives the default CPU path's tokens and logits."""
    if DEVICE.type != "cpu":
        pytest.skip("the interpreter run")
    assert_paths_agree(tiny(tmp_path, family), 5, None)


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral"])
def test_fp8_kv_stays_close_to_fp32(family: str, tmp_path: Path) -> None:
    """An fp8 KV pool (scales calibrated through the MoE model's own forward) changes the
    logits by quantization error only (the model table's fp8 KV column)."""
    path = tiny(tmp_path, family)
    spec = read_model_spec(path)
    prompts = random_prompts([5, 11, 1], 250, seed=2)

    def run(fp8: bool) -> torch.Tensor:
        model = load_model(path, spec, TorchAttentionBackend(), 64, torch.float32, CPU)
        kv = None
        if fp8:
            fmt = torch.float8_e4m3fn
            kv = (fmt, calibrate(model, prompts[1], fmt, spec.num_kv_heads, spec.head_dim,
                                 torch.float32, CPU))
        return torch.cat(greedy(model, prompts, 2, kv)[1])  # (prefill + decode rows, vocab)

    want = run(False)
    rel = ((run(True) - want).norm() / want.norm()).item()
    assert 0 < rel < 0.05, rel
