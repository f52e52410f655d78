"""Tensor parallelism in the real engine (gloo on CPU, fp32): TP 2 gives TP 1's greedy tokens,
radix hits, chunked prefill and preemption; a dead rank fails the engine at once, clearly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from radixserve import LLM, SamplingParams
from radixserve.config import ConfigError, EngineConfig
from radixserve.engine.tp_ranks import TPFailedError
from tests.engine.test_engine_cache import run_checked, shared_prefix_prompts
from tests.repo import REPO_ROOT
from tests.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def make_llm(model: Path, tp: int, **kw: object) -> LLM:
    kw.setdefault("kv_cache_tokens", 8192)
    return LLM(model=str(model), dtype="float32", tensor_parallel_size=tp, **kw)


def gone(pid: int) -> bool:
    """No such process, or only its zombie (it runs no more)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.fixture(scope="module")
def tiny_mistral(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny_mistral"), "mistral", seed=3)


@pytest.mark.parametrize("fixture", ["tiny_llama", "tiny_qwen2", "tiny_mistral",
                                     "tiny_llama_tied"])
def test_tp2_greedy_tokens_and_cache_hits_equal_tp1(fixture: str,
                                                      request: pytest.FixtureRequest) -> None:
    """tiny_llama_tied: one KV head (replicated on both ranks) and a tied, vocab-parallel
    embedding / LM head; the tiny vocabulary (259) splits unevenly (130 + 129 + padding)."""
    model: Path = request.getfixturevalue(fixture)
    prompts = shared_prefix_prompts(2, 3, 40, 5)
    results = {}
    for tp in (1, 2):
        llm = make_llm(model, tp)
        try:
            outs = run_checked(llm, prompts)
            again = llm.generate(prompts[:2], GREEDY)  # fully warm: hits the tree
            stats = llm.kv_stats()
        finally:
            llm.close()
        results[tp] = (outs, [o.token_ids for o in again], [o.num_cached_tokens for o in again],
                       stats["prefix_cache_hits"])
    assert results[2] == results[1]
    assert results[2][2] == [44, 44] and results[2][3] > 0
    assert stats["tp_size"] == 2 and stats["tp_steps"] > 0 and stats["tp_collective_seconds"] > 0


def test_tp2_chunked_prefill_and_preemption_lose_nothing(tiny_llama: Path) -> None:
    prompts = shared_prefix_prompts(3, 4, 40, 9, seed=1)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    base = run_checked(make_llm(tiny_llama, 1), prompts, params)
    llm = make_llm(tiny_llama, 2, kv_cache_tokens=260, max_model_len=256,
                   chunked_prefill_size=16, max_prefill_tokens=24)
    try:
        assert run_checked(llm, prompts, params) == base
        assert llm.kv_stats()["num_preemptions"] > 0
    finally:
        llm.close()


def test_a_killed_rank_fails_the_engine_within_seconds(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama, 2)
    pids = llm.engine.info["tp_worker_pids"]
    assert len(pids) == 1 and llm.engine.info["tensor_parallel_size"] == 2
    try:
        assert len(llm.generate([[5, 6, 7]], GREEDY)[0].token_ids) == 10
        os.kill(pids[0], signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(TPFailedError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
            llm.generate([[5, 6, 7, 8]], GREEDY)
        assert time.monotonic() - t0 < 10
        with pytest.raises(TPFailedError):  # an idle engine learns it from its stats too
            llm.kv_stats()
    finally:
        llm.close()
    assert gone(pids[0])


def test_close_stops_every_worker(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama, 2, kv_cache_tokens=1024)
    pids = llm.engine.info["tp_worker_pids"]
    llm.generate([[1, 2, 3]], GREEDY)
    llm.close()
    assert all(gone(pid) for pid in pids)


def test_sizes_the_heads_do_not_allow_are_refused_before_any_process_starts(
        tiny_llama: Path) -> None:
    # the tiny Llama: 4 heads, 2 KV heads
    with pytest.raises(ConfigError, match=r"tensor_parallel_size 3 .*4 attention heads"):
        make_llm(tiny_llama, 3)


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1"),
    ({"tensor_parallel_size": 3, "nnodes": 2, "dist_init_addr": "h:1"}, "multiple of nnodes"),
    ({"tensor_parallel_size": 4, "nnodes": 2}, "--dist-init-addr"),
    ({"tensor_parallel_size": 2, "node_rank": 1}, "node_rank"),
    ({"tensor_parallel_size": 2, "dist_init_addr": "nohost"}, "HOST:PORT"),
    ({"tensor_parallel_size": 2, "kv_cache_dtype": "fp8"}, "kv_cache_dtype"),
    ({"tensor_parallel_size": 2, "kv_offload_dir": "/tmp/x"}, "kv-offload-dir"),
])
def test_config_refusals(kwargs: dict[str, object], words: str) -> None:
    with pytest.raises(ConfigError, match=words):
        EngineConfig(**kwargs)  # type: ignore[arg-type]


@pytest.mark.slow
@pytest.mark.smollm2
def test_smollm2_tp3_equals_tp1_and_tp2_is_refused() -> None:
    """SmolLM2-135M: 9 query heads, 3 KV heads, one KV head per rank at TP 3."""
    with pytest.raises(ConfigError, match="9 attention heads.*Sizes this model allows: 1, 3$"):
        LLM(model="smollm2-135m", dtype="float32", tensor_parallel_size=2)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=16)
    results = {}
    for tp in (1, 3):
        llm = LLM(model="smollm2-135m", dtype="float32", tensor_parallel_size=tp,
                  kv_cache_tokens=4096, max_model_len=512)
        try:
            results[tp] = [o.token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.close()
    assert results[3] == results[1] and all(len(t) > 0 for t in results[1])


def test_a_worker_dead_before_joining_fails_the_start_at_once(tiny_llama: Path) -> None:
    """A program read from stdin cannot be re-imported by a spawned child, so its worker dies
    while starting: rank 0 must say so at once, not wait out the rendezvous timeout."""
    code = (f"from radixserve import LLM\n"
            f"LLM(model={str(tiny_llama)!r}, dtype='float32', tensor_parallel_size=2)\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert out.returncode != 0 and time.monotonic() - t0 < 60
    assert "TPFailedError: tensor-parallel rank 1 (pid" in out.stderr


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton kernels on CPU need the interpreter (conftest sets it "
                           "without CUDA)")
def test_tp2_on_the_fused_triton_forward_equals_tp1(tiny_llama: Path) -> None:
    """The forward CUDA runs (model/layers/' fused path, Triton attention), here under Triton's
    interpreter on CPU: its all-reduces and logits gather give TP 1's tokens."""
    prompts = [list(range(3, 30)), [5, 6, 7]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    results = {}
    for tp in (1, 2):
        llm = make_llm(tiny_llama, tp, device="cpu", attention_backend="triton",
                       kv_cache_tokens=2048, max_model_len=256)
        try:
            assert llm.engine.runner.model.fused
            results[tp] = [o.token_ids for o in llm.generate(prompts, params)]
        finally:
            llm.close()
    assert results[2] == results[1]
