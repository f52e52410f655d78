"""Overlap scheduling (engine/overlap.py) gives exactly the tokens of the synchronous loop.

Greedy fp32 on CPU with overlap forced on (`overlap_on_cpu`; on CUDA it is the default), over a
batch mixing max_tokens limits, stop token ids and EOS, a grammar-constrained request and a
seeded sampled one (both run without overlap while in the batch), preemption (a small pool),
and speculation (its requests run without overlap); on the synchronous device and on a
simulated asynchronous one (DeviceQueue: a worker thread running the forwards' device time
in order, as a CUDA stream, while the host launches ahead). Each run checks
the page invariant after every step and that steps really overlapped. Stop strings are matched
by the API process on the streamed token ids, which are these.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import pytest

from radixserve import LLM, Constraint, SamplingParams
from radixserve.cli import build_config, build_parser
from radixserve.config import EngineConfig
from radixserve.engine.overlap import DeviceQueue
from radixserve.ipc.messages import GenerateMsg

PROMPTS = [list(range(3, 3 + n)) for n in (5, 9, 17, 30, 12, 44, 20, 21)]


def batch_params(stop_id: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, stop_token_ids=(stop_id,)),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=25, constraint=Constraint.regex("[a-c]{1,6}")),
        SamplingParams(temperature=0.8, max_tokens=9, seed=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=90, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=90, ignore_eos=True),
    ]


def run(llm: LLM, params: list[SamplingParams], queue: bool = False) -> list[list[int]]:
    engine = llm.engine
    if queue:
        # Each forward also queues 1 ms of device time, so the host runs ahead of the device
        # and reads a step's tokens only after the device got past it (InFlight.marker).
        engine.device_queue = device = DeviceQueue()
        forward = engine.runner.model.forward

        def launched(*args: Any, **kwargs: Any) -> Any:
            device.submit(functools.partial(time.sleep, 0.001))
            return forward(*args, **kwargs)

        engine.runner.model.forward = launched  # type: ignore[method-assign]
    for i, (p, sp) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(GenerateMsg(f"r{i}", p, sp))
    toks: dict[str, list[int]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    while engine.has_work():
        for out in engine.step():
            assert out.error is None
            if out.token_id is not None:
                toks[out.rid].append(out.token_id)
        engine.check_integrity()
    assert llm.kv_stats()["kv_held_tokens"] == 0
    return [toks[f"r{i}"] for i in range(len(PROMPTS))]


def make(model: Path, overlap: bool, **kw: Any) -> LLM:
    kw.setdefault("kv_cache_tokens", 4096)
    return LLM(model=str(model), dtype="float32", overlap_on_cpu=overlap, **kw)


@pytest.mark.parametrize("queue", [False, True], ids=["sync-device", "simulated-device"])
def test_overlap_gives_the_synchronous_tokens(tiny_llama: Path, queue: bool) -> None:
    pool = 4096
    base = make(tiny_llama, False, kv_cache_tokens=pool, max_model_len=256)
    stop_id = run(base, [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)] * 8)[1][2]
    base = make(tiny_llama, False, kv_cache_tokens=pool, max_model_len=256)
    want = run(base, batch_params(stop_id))
    assert base.engine.num_overlapped_steps == 0
    llm = make(tiny_llama, True, kv_cache_tokens=pool, max_model_len=256)
    got = run(llm, batch_params(stop_id), queue)
    assert got == want
    assert llm.engine.num_overlapped_steps > 10
    assert len(want[0]) == 3 and want[1][-1] == stop_id and len(want[5]) == 40
    llm.close()


def test_overlap_under_preemption_gives_the_synchronous_tokens(tiny_llama: Path) -> None:
    from tests.engine.test_engine_cache import run_checked, shared_prefix_prompts

    prompts = shared_prefix_prompts(3, 4, 40, 9, seed=1)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = run_checked(make(tiny_llama, False, kv_cache_tokens=260, max_model_len=256),
                       prompts, params)
    llm = make(tiny_llama, True, kv_cache_tokens=260, max_model_len=256)
    assert run_checked(llm, prompts, params) == want
    assert llm.kv_stats()["num_preemptions"] > 0 and llm.engine.num_overlapped_steps > 10


def test_overlap_with_speculation_gives_the_synchronous_tokens(tiny_llama: Path) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 2}
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)] * len(PROMPTS)
    want = run(make(tiny_llama, False, speculative_config=spec), params)
    got = run(make(tiny_llama, True, speculative_config=spec), params)
    assert got == want


def test_the_flag_as_sglang_writes_it() -> None:
    args = build_parser().parse_args(["serve", "--model", "m", "--disable-overlap-schedule"])
    cfg = build_config(args, {})
    assert cfg.engine.disable_overlap_schedule
    assert not EngineConfig().disable_overlap_schedule


def test_disabled_or_cpu_runs_without_overlap(tiny_llama: Path) -> None:
    assert not make(tiny_llama, False).engine.overlap  # CPU: synchronous by default
    llm = LLM(model=str(tiny_llama), dtype="float32", overlap_on_cpu=True,
              disable_overlap_schedule=True, kv_cache_tokens=4096)
    assert not llm.engine.overlap


@pytest.mark.gpu
def test_overlap_on_cuda_gives_the_synchronous_tokens(tiny_llama: Path) -> None:
    params = batch_params(5)
    want = run(LLM(model=str(tiny_llama), dtype="float32", device="cuda",
                   disable_overlap_schedule=True, kv_cache_tokens=4096), params)
    llm = LLM(model=str(tiny_llama), dtype="float32", device="cuda", kv_cache_tokens=4096)
    assert llm.engine.overlap
    assert run(llm, params) == want and llm.engine.num_overlapped_steps > 10
