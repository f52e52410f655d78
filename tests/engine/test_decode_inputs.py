"""A plain decode step's inputs, built from the persistent view of the running set, equal
what the general path builds from the same batch's entries (tiny model, fp32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve.engine.model_runner import StepInputs
from radixserve.ipc.messages import GenerateMsg
from radixserve.sched.req import Batch
from radixserve.types import Phase, SamplingParams
from tests.engine.test_engine_cache import make_llm, shared_prefix_prompts
from triton_kernels.testing import device_or_error


def assert_same_inputs(a: StepInputs, b: StepInputs) -> None:
    for name in ("input_ids", "positions", "logit_rows"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    for name in ("rows", "prefix_lens", "extend_lens", "seq_lens", "cu_extend", "out_slots",
                 "own_start"):
        x, y = getattr(a.meta, name), getattr(b.meta, name)
        assert x.dtype == y.dtype and torch.equal(x, y), name
    for name in ("phase", "prefix_lens_cpu", "extend_lens_cpu", "max_seq_len",
                 "max_extend_len", "rows_cpu", "own_start_cpu"):
        assert getattr(a.meta, name) == getattr(b.meta, name), name
    assert len(a.meta.shared) == len(b.meta.shared)
    for x, y in zip(a.meta.shared, b.meta.shared, strict=True):
        assert (x.members_cpu, x.length, x.first_slot) == (y.members_cpu, y.length, y.first_slot)
        assert torch.equal(x.slots, y.slots) and torch.equal(x.members, y.members)


def test_plain_decode_inputs_equal_the_general_path(tiny_llama: Path) -> None:
    llm = make_llm(tiny_llama)
    engine, runner, sched = llm.engine, llm.engine.runner, llm.engine.scheduler
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # One 80-token system prompt: the requests after the first match it in the tree, so
    # their decode steps attend to a shared prefix group.
    for i, prompt in enumerate(shared_prefix_prompts(1, 4, 80, 5)):
        engine.add_request(GenerateMsg(f"r{i}", prompt, params))
    compared = grouped = 0
    while engine.has_work():
        batch = sched.schedule()
        assert batch is not None
        if batch.rows is not None:
            fast = runner.prepare(batch)
            general = runner.prepare(Batch(Phase.DECODE, list(batch.entries)))
            assert_same_inputs(fast, general)
            compared += 1
            grouped += bool(fast.meta.shared)
        result = runner.run(batch)
        sched.process_outputs(batch, result.token_ids, result.logprobs)
        engine.check_integrity()
    assert compared >= 8 and grouped >= 1


def test_shared_prefixes_are_built_only_for_a_backend_that_reads_them(tiny_llama: Path) -> None:
    """The torch backend attends a group's shared tree prefix once; the Triton backend reads
    each request's own slot-table row, so the runner builds no groups for it (and its greedy
    tokens stay the torch backend's). The Triton backend runs under the interpreter on CPU."""
    device, error = device_or_error()
    if error:
        pytest.fail(error, pytrace=False)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens: dict[str, list[list[int]]] = {}
    grouped: dict[str, int] = {}
    for backend in ("torch", "triton"):
        llm = make_llm(tiny_llama, attention_backend=backend, device=device.type)
        engine, runner, sched = llm.engine, llm.engine.runner, llm.engine.scheduler
        assert runner.model.backend.reads_shared_prefixes is (backend == "torch")
        for i, prompt in enumerate(shared_prefix_prompts(1, 4, 80, 5)):
            engine.add_request(GenerateMsg(f"r{i}", prompt, params))
        tokens[backend], grouped[backend] = [], 0
        while engine.has_work():
            batch = sched.schedule()
            assert batch is not None
            if batch.rows is not None:
                meta = runner.prepare(batch).meta
                grouped[backend] += bool(meta.shared)
                assert meta.shared or set(meta.own_start_cpu) == {0}
            result = runner.run(batch)
            tokens[backend].append(list(result.token_ids))
            sched.process_outputs(batch, result.token_ids, result.logprobs)
    assert grouped["torch"] >= 1 and grouped["triton"] == 0
    assert tokens["triton"] == tokens["torch"]
