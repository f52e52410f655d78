"""bench.gpu on a machine without CUDA (a clear message, exit 2) and the parts of it that run
anywhere: the shapes' parameter counts against HF's own, the tokenizer that covers the
vocabulary, the profiler reductions and the report table."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from bench.common.gpu_models import SHAPES, hf_config, hf_model, save_tokenizer, shape_named
from bench.common.step_profile import is_device_kernel, is_launch, union_us
from bench.gpu import markdown
from tests.repo import REPO_ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a CPU-only machine")
def test_without_cuda_it_says_so_and_exits_2() -> None:
    out = subprocess.run([sys.executable, "-m", "bench.gpu"], capture_output=True, text=True,
                         timeout=120, cwd=REPO_ROOT)
    assert out.returncode == 2
    assert "bench.gpu needs a CUDA GPU" in out.stderr and out.stdout == ""


@pytest.mark.parametrize("name", list(SHAPES))
def test_parameter_counts_are_hf_own(name: str) -> None:
    shape = SHAPES[name]
    with torch.device("meta"):
        model = hf_model(hf_config(shape, 4096))
    assert shape.num_params() == sum(p.numel() for p in model.parameters())
    if shape.experts:  # one token's experts: the top-k of each layer's
        per_expert = 3 * shape.hidden * shape.expert_intermediate
        inactive = shape.layers * (shape.experts - shape.top_k) * per_expert
        assert shape.num_params(active=True) == shape.num_params() - inactive


def test_shapes_match_the_issue() -> None:
    assert SHAPES["smollm2-135m"].num_params() == 134_515_008  # SmolLM2-135M's published count
    llama = SHAPES["llama-1b"]
    assert round(llama.step_weight_bytes() / 1e9, 1) == 2.1  # issue 28's floor: 2.1 GB
    assert shape_named("llama-1b", 128256).vocab == 128256


def test_the_tokenizer_decodes_every_id(tmp_path: Path) -> None:
    save_tokenizer(tmp_path, 300)
    tok = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    assert len(tok) == 300 and tok.eos_token_id == 0
    assert tok.decode([299, 1, 150]) == "t299 t1 t150"
    assert tok.encode("t7 t8", add_special_tokens=False) == [7, 8]


def test_union_of_intervals() -> None:
    assert union_us([(0, 10), (5, 15), (20, 30)], 0, 100) == 25
    assert union_us([(0, 10), (5, 15), (20, 30)], 8, 25) == 12  # clipped: [8,15) + [20,25)
    assert union_us([(3, 4), (0, 10)], 0, 100) == 10  # nested
    assert union_us([], 0, 10) == 0


def test_event_names() -> None:
    assert is_launch("cudaLaunchKernel") and is_launch("cuLaunchKernelEx")
    assert is_launch("cudaGraphLaunch") and not is_launch("cudaMemcpyAsync")
    assert is_device_kernel("ampere_bf16_gemm") and not is_device_kernel("Memcpy HtoD")


def test_markdown_table() -> None:
    profile = {"batch": 64, "steps": 32, "step_ms": 2.5, "gpu_busy": 0.85,
               "kernels_per_step": 400.0, "launches_per_step": 1.0}
    report = {"gpu": "NVIDIA H200", "torch": "2.11", "hbm_gbps": 4300.0,
              "hbm_source": "measured", "batches": [1, 64], "input_len": 256, "output_len": 128,
              "models": {"llama-1b": {
                  "shape": {"step_weight_bytes": 2.15e9}, "floor_step_ms": 0.5,
                  "floor_tok_s_batch1": 2000.0,
                  "rows": {"radixserve": {"tok_s": {1: 800.0, 64: 30000.0},
                                          "profile": [profile]},
                           "HF generate": {"tok_s": {1: 20.0, 64: 1000.0}}}}}}
    text = markdown(report)
    assert "| llama-1b shape, radixserve | 800.0 (1.25 ms/token) | 30,000 |" in text
    assert "| llama-1b shape, HF generate | 20.0 (50.00 ms/token) | 1,000 |" in text
    assert "| llama-1b | 2.15 GB | 0.50 | 2,000 |" in text
    assert "| llama-1b, radixserve | 64 | 2.50 | 85% | 400 | 1 |" in text
