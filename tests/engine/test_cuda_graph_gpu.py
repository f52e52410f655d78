"""CUDA graphs on a GPU: greedy tokens identical with graphs on and off (fp32), a replay
identical to an eager run over the same padded buffers (bf16), the start-up log line, batches
past --cuda-graph-max-bs running eagerly, and speculative verify steps through graphs."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from radixserve import LLM
from radixserve.engine.cuda_graph import CudaGraphRunner
from radixserve.engine.graph_inputs import GraphKind
from radixserve.ipc.messages import GenerateMsg
from radixserve.types import SamplingParams
from tests.model.test_parity import random_prompts
from tests.speculative.test_engine import run, spec_stats, tokens

pytestmark = pytest.mark.gpu

PROMPTS = random_prompts([3, 17, 40, 9, 64, 5, 33, 120, 7, 11], 250, seed=3)
# Ten requests finishing one by one: batches 10 .. 1 take buckets 16, 8, 4, 2, 1.
PARAMS = [SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True)
          for i in range(len(PROMPTS))]


def make(model: Path, **kw: Any) -> LLM:
    kw.setdefault("dtype", "float32")
    return LLM(model=str(model), device="cuda", kv_cache_tokens=8192, **kw)


def generate(llm: LLM) -> list[list[int]]:
    out = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    llm.engine.check_integrity()
    assert llm.kv_stats()["kv_held_tokens"] == 0
    return out


def test_greedy_tokens_identical_with_graphs_on_and_off(
        tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    eager = generate(make(tiny_llama, enforce_eager=True, cuda_graph_max_bs=16))
    with caplog.at_level(logging.INFO, logger="radixserve.engine.cuda_graph"):
        llm = make(tiny_llama, cuda_graph_max_bs=16)
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    assert sorted(k.bs for k in graphs.graphs) == [1, 2, 4, 8, 16]
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("CUDA graphs: captured 5 graphs in ")
               and line.endswith("(decode batch sizes 1, 2, 4, 8, 16)") for line in lines), lines
    assert generate(llm) == eager
    assert graphs.num_steps[GraphKind.DECODE] >= 20


def test_a_replay_is_the_eager_run_of_the_same_padded_buffers(tiny_llama: Path) -> None:
    """bf16: the graph replays exactly the kernels an eager forward over the padded buffers
    launches, so even bf16 tokens are identical."""
    llm = make(tiny_llama, dtype="bfloat16", cuda_graph_max_bs=16)
    runner = llm.engine.runner
    assert runner.graphs is not None
    replayed = generate(llm)
    runner.graphs = CudaGraphRunner(runner.graphs.plan, runner.model, runner.pool,
                                    runner.spec.vocab_size)  # the same buffers, not captured
    assert generate(llm) == replayed
    assert runner.graphs.num_steps[GraphKind.DECODE] >= 20


def test_batches_past_the_max_run_eagerly(tiny_llama: Path) -> None:
    eager = generate(make(tiny_llama, enforce_eager=True))
    llm = make(tiny_llama, cuda_graph_max_bs=4)
    graphs = llm.engine.runner.graphs
    assert graphs is not None and sorted(k.bs for k in graphs.graphs) == [1, 2, 4]
    assert generate(llm) == eager
    # 21 decode steps: those of 10..5 requests (the first 13) eager, the last 8 replayed.
    assert 0 < graphs.num_steps[GraphKind.DECODE] <= 10


def test_speculative_verify_steps_through_graphs(
        tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    prompts = random_prompts([12, 30, 7, 90], 250, seed=5)

    def msgs(predictions: dict[str, list[int]] | None) -> list[GenerateMsg]:
        return [GenerateMsg(f"r{i}", p, SamplingParams(temperature=0, max_tokens=24),
                            prediction_ids=None if predictions is None else predictions[f"r{i}"])
                for i, p in enumerate(prompts)]

    plain = tokens(run(make(tiny_llama, enforce_eager=True), msgs(None)))
    wrong = {rid: [t if i % 5 else (t + 1) % 250 for i, t in enumerate(ids)]
             for rid, ids in plain.items()}
    with caplog.at_level(logging.INFO, logger="radixserve.engine.cuda_graph"):
        llm = make(tiny_llama, cuda_graph_max_bs=8,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    assert any("verify (3 draft tokens) batch sizes 1, 2, 4, 8" in r.getMessage()
               for r in caplog.records)
    graphs = llm.engine.runner.graphs
    assert graphs is not None
    assert tokens(run(llm, msgs(wrong), check_every_step=True)) == plain
    assert graphs.num_steps[GraphKind.VERIFY] > 0
    assert spec_stats(llm)["spec_num_accepted_tokens"] > 20
