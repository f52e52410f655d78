"""Every family's greedy fp32 tokens equal HF transformers' own generate, on every path.

Tiny random models (tests/family_models.py: odd shapes, sliding windows shorter than the
prompts, soft-caps, QK-norm, partial rotary, yarn/longrope/linear scaling), built once per
session. Paths: the engine on the native CPU kernels (radix cache on, hit by the same prompts
again, and off; chunked prefill of 16; preemption; TP 2), and the model alone on the torch
backend without native kernels and on the Triton kernels under the interpreter (fused).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationMixin

from radixserve import LLM
from radixserve.attention.cpu_kernels import ENV_DISABLE
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.attention.triton_backend import TritonAttentionBackend
from radixserve.engine.kv_calibration import calibrate
from radixserve.model.families.registry import load_model, read_model_spec
from radixserve.types import SamplingParams
from tests.engine.test_engine_cache import shared_prefix_prompts
from tests.family_models import CASES, make_family_model
from tests.model.test_fused_forward import MAX_LEN, greedy
from tests.model.test_parity import random_prompts
from triton_kernels.testing import device_or_error

VOCAB = 250
N = 6  # new tokens per prompt
LENGTHS = [1, 13, 37, 5]  # the windows (8) are shorter than all but two
_DEVICE, DEVICE_ERROR = device_or_error()
CPU = torch.device("cpu")


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Each case's model folder, built on first use (the session shares them)."""
    return {}


def model_dir(family_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory,
              case: str) -> Path:
    if case not in family_dirs:
        family_dirs[case] = make_family_model(tmp_path_factory.mktemp(case), case)
    return family_dirs[case]


@pytest.fixture(scope="session")
def reference(family_dirs: dict[str, Path]) -> dict[str, list[list[int]]]:
    """HF's greedy tokens per case (computed once)."""
    return {}


@pytest.fixture(params=CASES)
def case(request: pytest.FixtureRequest, family_dirs: dict[str, Path],
         tmp_path_factory: pytest.TempPathFactory,
         reference: dict[str, list[list[int]]]) -> tuple[Path, list[list[int]]]:
    path = model_dir(family_dirs, tmp_path_factory, request.param)
    if request.param not in reference:
        reference[request.param] = hf_greedy(path, random_prompts(LENGTHS, VOCAB), N)
    return path, reference[request.param]


def hf_greedy(model_dir: Path, prompts: list[list[int]], n: int) -> list[list[int]]:
    return hf_model_greedy(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
                           prompts, n)


def hf_model_greedy(hf: GenerationMixin, prompts: list[list[int]], n: int) -> list[list[int]]:
    """A loaded HF model's generate, greedy, n tokens, EOS a token like any other (as
    ignore_eos: HF's min_new_tokens would instead forbid EOS, a different argmax where EOS
    wins)."""
    hf.generation_config.eos_token_id = None
    outs = []
    for p in prompts:
        seq = hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False,
                          attention_mask=torch.ones(1, len(p), dtype=torch.long))
        assert seq.shape[1] == len(p) + n
        outs.append(seq[0, len(p):].tolist())
    return outs


def engine_tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    out = [o.token_ids for o in llm.generate(prompts, params)]
    llm.engine.check_integrity()
    return out


def test_engine_matches_hf_with_cache_on_and_off_and_chunked(
        case: tuple[Path, list[list[int]]]) -> None:
    path, want = case
    prompts = random_prompts(LENGTHS, VOCAB)
    cached = LLM(model=str(path), dtype="float32", kv_cache_tokens=4096)
    assert engine_tokens(cached, prompts) == want
    assert engine_tokens(cached, prompts) == want  # the second time from the radix tree
    assert cached.kv_stats()["prefix_cache_hits"] > 0
    uncached = LLM(model=str(path), dtype="float32", kv_cache_tokens=4096,
                   disable_radix_cache=True, chunked_prefill_size=16, max_prefill_tokens=24)
    assert engine_tokens(uncached, prompts) == want


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_model_alone_matches_hf_on_torch_and_triton(case: tuple[Path, list[list[int]]],
                                                    backend: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """torch: the backend and norm/RoPE without native kernels; triton: the fused path under
    the interpreter (partial rotary: the Triton backend's unfused order)."""
    if backend == "triton" and DEVICE_ERROR:
        pytest.fail(DEVICE_ERROR, pytrace=False)
    path, want = case
    monkeypatch.setenv(ENV_DISABLE, "1")  # torch's RMSNorm/RoPE, not the native ops
    be = TorchAttentionBackend() if backend == "torch" else TritonAttentionBackend(2)
    model = load_model(path, read_model_spec(path), be, MAX_LEN, torch.float32, CPU)
    assert model.fused == (backend == "triton")
    prompts = random_prompts(LENGTHS, VOCAB)
    steps = 3 if backend == "triton" else N  # the interpreter is slow: fewer decode steps
    tokens, _ = greedy(model, prompts, steps)  # the prefill's token, then steps - 1 decodes'
    assert tokens == [w[:steps] for w in want]


@pytest.mark.parametrize("name", ["qwen3_swa", "gemma2", "gemma3", "phi3"])
def test_preemption_under_a_tiny_pool_matches_hf(name: str, family_dirs: dict[str, Path],
                                                 tmp_path_factory: pytest.TempPathFactory
                                                 ) -> None:
    """12 requests of 49-token prompts (3 shared system prompts) and 40 new tokens each over a
    pool of 260 slots: requests are preempted and recomputed (over the tree's pages)."""
    path = model_dir(family_dirs, tmp_path_factory, name)
    prompts = shared_prefix_prompts(3, 4, 40, 9, seed=1)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    llm = LLM(model=str(path), dtype="float32", kv_cache_tokens=260, max_model_len=128)
    got = [o.token_ids for o in llm.generate(prompts, params)]
    llm.engine.check_integrity()
    assert llm.kv_stats()["num_preemptions"] > 0
    assert got == hf_greedy(path, prompts, 40)


@pytest.mark.parametrize("name", ["qwen3", "gemma2", "phi3"])
def test_tp2_matches_hf(name: str, family_dirs: dict[str, Path],
                        tmp_path_factory: pytest.TempPathFactory,
                        reference: dict[str, list[list[int]]]) -> None:
    """qwen3: one KV head (replicated) and tied embeddings; gemma2: the final soft-cap over the
    gathered vocabulary; phi3: the fused qkv_proj / gate_up_proj sliced per rank."""
    path = model_dir(family_dirs, tmp_path_factory, name)
    prompts = random_prompts(LENGTHS, VOCAB)
    want = reference.get(name) or hf_greedy(path, prompts, N)
    llm = LLM(model=str(path), dtype="float32", kv_cache_tokens=4096, tensor_parallel_size=2)
    try:
        assert engine_tokens(llm, prompts) == want
        assert engine_tokens(llm, prompts) == want  # from the tree
        assert llm.kv_stats()["prefix_cache_hits"] > 0
    finally:
        llm.close()


@pytest.mark.parametrize("name", ["qwen3", "gemma2", "gemma3", "phi3"])
def test_int8_weights_and_fp8_kv_stay_close_to_fp32(name: str, family_dirs: dict[str, Path],
                                                    tmp_path_factory: pytest.TempPathFactory
                                                    ) -> None:
    """int8 weights (every projection and the LM head) and an fp8 KV pool (scales calibrated
    through the family's own forward) change the logits by quantization error only."""
    path = model_dir(family_dirs, tmp_path_factory, name)
    spec = read_model_spec(path)
    prompts = random_prompts(LENGTHS, VOCAB)

    def run(quantization: str | None, fp8: bool) -> torch.Tensor:
        model = load_model(path, spec, TorchAttentionBackend(), MAX_LEN, torch.float32, CPU,
                           quantization=quantization)
        kv = None
        if fp8:
            fmt = torch.float8_e4m3fn
            kv = (fmt, calibrate(model, prompts[2], fmt, spec.num_kv_heads, spec.head_dim,
                                 torch.float32, CPU))
        return torch.cat(greedy(model, prompts, 2, kv)[1])  # (prefill + decode rows, vocab)

    want = run(None, False)
    for quantization, fp8 in ((None, True), ("int8", False)):
        rel = ((run(quantization, fp8) - want).norm() / want.norm()).item()
        assert 0 < rel < 0.05, (quantization, fp8, rel)
