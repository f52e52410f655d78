"""CUDA-graph decode, the parts that run on CPU: buckets, the padded static buffers, the flags
on their way to the plan, and whole generations through the padded buffers (run eagerly, as
a graph would replay them) giving the tokens of the unpadded path."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from radixserve import LLM
from radixserve.attention.base import AttentionMetadata
from radixserve.cli import build_config, build_parser
from radixserve.config import ConfigError, EngineConfig
from radixserve.engine.cuda_graph import (
    MAX_VERIFY_BS,
    CudaGraphRunner,
    GraphPlan,
    graph_key,
    plan_graphs,
)
from radixserve.engine.graph_inputs import (
    GraphKind,
    StaticInputs,
    bucket_for,
    describe_sizes,
    graph_batch_sizes,
    strided_rows,
)
from radixserve.engine.step_inputs import StepInputs
from radixserve.ipc.messages import GenerateMsg
from radixserve.sched.req import Batch, Req, ScheduledReq
from radixserve.types import Phase, SamplingParams
from tests.model.test_parity import random_prompts
from tests.speculative.test_engine import run, spec_stats, tokens
from triton_kernels.testing import InterpreterOffError, default_device

CUDA = torch.device("cuda")  # a device object only: plan_graphs never touches the GPU


def test_batch_sizes_are_powers_to_8_then_every_8_up_to_the_max() -> None:
    sizes = graph_batch_sizes(256)
    assert sizes[:6] == (1, 2, 4, 8, 16, 24) and sizes[-2:] == (248, 256)
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:], strict=False))
    assert graph_batch_sizes(10) == (1, 2, 4, 8, 10)  # the max itself, off the grid
    assert graph_batch_sizes(3) == (1, 2, 3)
    assert graph_batch_sizes(1) == (1,)
    with pytest.raises(ValueError):
        graph_batch_sizes(0)
    assert describe_sizes(sizes) == "1, 2, 4, 8, 16..256 every 8"
    assert describe_sizes((1, 2, 3)) == "1, 2, 3"
    assert describe_sizes(graph_batch_sizes(16)) == "1, 2, 4, 8, 16"
    assert describe_sizes(graph_batch_sizes(30)) == "1, 2, 4, 8, 16, 24, 30"
    assert describe_sizes(graph_batch_sizes(44)) == "1, 2, 4, 8, 16..40 every 8, 44"


def test_every_batch_takes_the_smallest_bucket_that_holds_it() -> None:
    for max_bs in (1, 7, 8, 9, 40, 256):
        sizes = graph_batch_sizes(max_bs)
        for b in range(1, max_bs + 1):
            assert bucket_for(b, sizes) == min(s for s in sizes if s >= b)
        assert bucket_for(max_bs + 1, sizes) is None


def test_strided_rows_place_each_request_at_its_stride() -> None:
    extend = torch.tensor([3, 1, 2], dtype=torch.int32)
    cu = torch.tensor([0, 3, 4, 6], dtype=torch.int32)
    assert strided_rows(extend, cu, 6, 4).tolist() == [0, 1, 2, 4, 8, 9]
    assert strided_rows(extend, cu, 6, 3).tolist() == [0, 1, 2, 3, 6, 7]


def step(extend_lens: list[int], prefix_lens: list[int], rows: list[int], first_slot: int,
         logit_rows: list[int] | None = None) -> StepInputs:
    """A step's packed inputs: token t has id 100 + t, slot first_slot + t."""
    num_tokens = sum(extend_lens)
    cu = [0]
    for n in extend_lens:
        cu.append(cu[-1] + n)
    pos = [p + j for p, n in zip(prefix_lens, extend_lens, strict=True) for j in range(n)]
    seq = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]

    def t(xs: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(xs, dtype=dtype)

    meta = AttentionMetadata(
        phase=Phase.DECODE, slot_table=torch.zeros(1, 1, dtype=torch.int32), rows=t(rows),
        prefix_lens=t(prefix_lens, torch.int32), extend_lens=t(extend_lens, torch.int32),
        seq_lens=t(seq, torch.int32), cu_extend=t(cu, torch.int32),
        out_slots=t(list(range(first_slot, first_slot + num_tokens))),
        prefix_lens_cpu=tuple(prefix_lens), extend_lens_cpu=tuple(extend_lens),
        max_seq_len=max(seq), max_extend_len=max(extend_lens), rows_cpu=tuple(rows))
    return StepInputs(t([100 + i for i in range(num_tokens)]), t(pos), meta,
                      t(logit_rows if logit_rows is not None else list(range(num_tokens))))


def test_a_smaller_step_overwrites_the_tail_a_larger_one_left() -> None:
    table = torch.zeros(9, 16, dtype=torch.int32)
    s = StaticInputs(8, 1, pad_row=8, pad_slot=999, slot_table=table)
    s.fill(step([1] * 7, [5, 6, 7, 8, 9, 10, 11], [0, 1, 2, 3, 4, 5, 6], 40), 8)
    keep = s.fill(step([1] * 5, [3, 3, 3, 3, 3], [6, 5, 4, 3, 2], 70), 8)
    assert keep.tolist() == [0, 1, 2, 3, 4]
    assert s.rows.tolist() == [6, 5, 4, 3, 2, 8, 8, 8]
    assert s.out_slots.tolist() == [70, 71, 72, 73, 74, 999, 999, 999]
    assert s.seq_lens.tolist() == [4] * 5 + [1] * 3
    assert s.input_ids.tolist() == [100, 101, 102, 103, 104, 0, 0, 0]
    assert s.positions.tolist() == [3] * 5 + [0] * 3
    meta = s.meta(8, step([1] * 5, [3] * 5, [6, 5, 4, 3, 2], 70).meta)
    assert meta.phase is Phase.DECODE and meta.batch_size == 8
    assert meta.rows_cpu == (6, 5, 4, 3, 2, 8, 8, 8) and meta.max_seq_len == 4
    assert meta.rows.data_ptr() == s.rows.data_ptr()  # views: what a graph reads


def test_a_verify_step_takes_stride_rows_per_request_and_pads_the_rest() -> None:
    table = torch.zeros(9, 16, dtype=torch.int32)
    s = StaticInputs(4, 4, pad_row=8, pad_slot=999, slot_table=table)
    s.fill(step([4, 4, 4], [1, 1, 1], [0, 1, 2], 10), 4)  # every row real, then a smaller step
    keep = s.fill(step([3, 1], [5, 9], [2, 0], 20, logit_rows=[0, 1, 2, 3]), 2)
    assert keep.tolist() == [0, 1, 2, 4]  # where the logits of the step's 4 tokens will be
    assert s.input_ids[:8].tolist() == [100, 101, 102, 0, 103, 0, 0, 0]
    assert s.positions[:8].tolist() == [5, 6, 7, 0, 9, 0, 0, 0]
    assert s.out_slots[:8].tolist() == [20, 21, 22, 999, 23, 999, 999, 999]
    assert s.extend_lens[:2].tolist() == [3, 1] and s.cu_extend[:3].tolist() == [0, 4, 8]
    meta = s.meta(2)
    assert meta.phase is Phase.PREFILL and meta.max_extend_len == 4
    assert meta.out_slots.shape == (8,) and meta.cu_extend.shape == (3,)


def test_which_batches_take_a_graph() -> None:
    """Decode batches up to the largest bucket; verify batches whose drafts fit K; never
    prefill or mixed steps."""
    plan = GraphPlan(graph_batch_sizes(16), graph_batch_sizes(4), verify_stride=4)
    req = Req("r", [1, 2, 3], 3, SamplingParams(), 8)

    def batch(phase: Phase, n: int, draft: tuple[int, ...] = ()) -> Batch:
        return Batch(phase, [ScheduledReq(req, 1 + len(draft), True, 0, draft)] * n)

    assert graph_key(plan, batch(Phase.DECODE, 5)) == (GraphKind.DECODE, 8)
    assert graph_key(plan, batch(Phase.DECODE, 16)) == (GraphKind.DECODE, 16)
    assert graph_key(plan, batch(Phase.DECODE, 17)) is None
    assert graph_key(plan, batch(Phase.DECODE, 3, (7, 8, 9))) == (GraphKind.VERIFY, 4)
    assert graph_key(plan, batch(Phase.DECODE, 5, (7,))) is None  # past the verify buckets
    assert graph_key(plan, batch(Phase.DECODE, 2, (7, 8, 9, 10))) is None  # a draft longer than K
    assert graph_key(plan, batch(Phase.PREFILL, 2)) is None
    assert graph_key(plan, batch(Phase.MIXED, 2)) is None


def serve_config(argv: list[str]) -> EngineConfig:
    return build_config(build_parser().parse_args(["serve", *argv]), {}).engine


def test_flags_reach_the_graph_plan() -> None:
    cfg = serve_config(["--cuda-graph-max-bs", "24", "--max-running-requests", "64"])
    assert (cfg.cuda_graph_max_bs, cfg.enforce_eager) == (24, False)
    plan = plan_graphs(cfg, CUDA, "triton")
    assert plan.decode_sizes == (1, 2, 4, 8, 16, 24) and plan.verify_sizes == ()
    capped = plan_graphs(serve_config(["--max-running-requests", "12"]), CUDA, "triton")
    assert capped.decode_sizes == (1, 2, 4, 8, 12)
    assert plan_graphs(EngineConfig(), CUDA, "triton").decode_sizes[-1] == 256  # the default
    eager = serve_config(["--enforce-eager", "--cuda-graph-max-bs", "8"])
    assert eager.enforce_eager and not plan_graphs(eager, CUDA, "triton").enabled
    assert plan_graphs(eager, CUDA, "triton").reason == "--enforce-eager"
    assert "cpu" in plan_graphs(cfg, torch.device("cpu"), "triton").reason
    assert not plan_graphs(cfg, CUDA, "torch").enabled
    spec = serve_config(["--speculative-config", '{"method": "ngram", '
                         '"num_speculative_tokens": 3}'])
    plan = plan_graphs(spec, CUDA, "triton")
    assert plan.verify_stride == 4 and plan.verify_sizes[-1] == MAX_VERIFY_BS
    assert "verify (3 draft tokens)" in plan.describe()


@pytest.mark.parametrize("value", [0, -1, True, 2.0])
def test_bad_cuda_graph_max_bs_is_a_config_error(value: object) -> None:
    with pytest.raises(ConfigError, match="cuda_graph_max_bs"):
        EngineConfig(cuda_graph_max_bs=value)  # type: ignore[arg-type]


def test_llm_accepts_the_flags_and_uses_no_graph_on_cpu(
        tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="radixserve.engine.cuda_graph"):
        llm = LLM(model=str(tiny_llama), enforce_eager=True, cuda_graph_max_bs=8,
                  dtype="float32", kv_cache_tokens=1024, device="cpu")
        other = LLM(model=str(tiny_llama), cuda_graph_max_bs=8, dtype="float32",
                    kv_cache_tokens=1024, device="cpu")
    assert (llm.engine.cfg.enforce_eager, llm.engine.cfg.cuda_graph_max_bs) == (True, 8)
    assert llm.engine.runner.graphs is None and other.engine.runner.graphs is None
    lines = [r.getMessage() for r in caplog.records]
    assert "CUDA graphs: not used (--enforce-eager)" in lines
    assert "CUDA graphs: not used (the device is cpu; graphs need CUDA)" in lines
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3


def pad_steps(llm: LLM, plan: GraphPlan) -> CudaGraphRunner:
    """Route the engine's decode (and verify) steps through the padded buffers, uncaptured.
    With the Triton backend (the graphs' own), with the capture-time metadata, as replayed."""
    r = llm.engine.runner
    r.graphs = CudaGraphRunner(plan, r.model, r.pool, r.spec.vocab_size,
                               fixed_meta=r.backend_name == "triton")
    return r.graphs


@pytest.fixture
def interpreter_device() -> torch.device:
    try:
        return default_device()
    except InterpreterOffError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_padded_decode_steps_give_the_unpadded_tokens(
        tiny_llama: Path, backend: str, interpreter_device: torch.device) -> None:
    """Five requests finishing at different steps: batches of 5, 4, 3, 2, 1 padded to buckets
    8, 4, 4, 2, 1 (and stale tails overwritten) give the eager path's greedy tokens."""
    prompts = random_prompts([3, 17, 40, 9, 64], 250, seed=2)
    params = [SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True)
              for i in range(5)]
    device = "cpu" if backend == "torch" else interpreter_device.type
    got = []
    for padded in (False, True):
        llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_tokens=2048, device=device,
                  attention_backend=backend)
        graphs = pad_steps(llm, GraphPlan(graph_batch_sizes(8))) if padded else None
        got.append([o.token_ids for o in llm.generate(prompts, params)])
        llm.engine.check_integrity()
        assert llm.kv_stats()["kv_held_tokens"] == 0
    assert got[1] == got[0]
    assert [len(t) for t in got[1]] == [4, 7, 10, 13, 16]
    assert graphs is not None and graphs.num_steps[GraphKind.DECODE] >= 12


@pytest.mark.slow
def test_padded_verify_steps_give_the_tokens_without_speculation(
        tiny_llama: Path, interpreter_device: torch.device) -> None:
    """Drafts of 0..3 tokens (a prediction with wrong tokens in it) verified in 4-token rows
    through the graph path's Triton kernels (the interpreter on CPU): the greedy tokens are
    those of plain decoding, and verify steps took the padded buffers."""
    prompts = random_prompts([12, 30, 7], 250, seed=5)

    def msgs(predictions: dict[str, list[int]] | None) -> list[GenerateMsg]:
        return [GenerateMsg(f"r{i}", p, SamplingParams(temperature=0, max_tokens=14),
                            prediction_ids=None if predictions is None else predictions[f"r{i}"])
                for i, p in enumerate(prompts)]

    def make(spec: dict[str, int | str] | None) -> LLM:
        return LLM(model=str(tiny_llama), dtype="float32", kv_cache_tokens=2048,
                   attention_backend="triton", device=interpreter_device.type,
                   speculative_config=spec)

    plain = tokens(run(make(None), msgs(None)))
    # Every fifth predicted token wrong: drafts are cut there, so verify rows hold 1..4 tokens.
    wrong = {rid: [t if i % 5 else (t + 1) % 250 for i, t in enumerate(ids)]
             for rid, ids in plain.items()}
    llm = make({"method": "ngram", "num_speculative_tokens": 3})
    graphs = pad_steps(llm, GraphPlan(graph_batch_sizes(4), graph_batch_sizes(4), 4))
    assert tokens(run(llm, msgs(wrong), check_every_step=True)) == plain
    assert graphs.num_steps[GraphKind.VERIFY] > 0
    assert spec_stats(llm)["spec_num_accepted_tokens"] > 5
