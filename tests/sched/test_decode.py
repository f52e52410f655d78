"""The scheduler's decode path: one reservation sum per admission round, the persistent view
of the running set (DecodeRows), and the vectorized stop test against the full rule."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

import radixserve.sched.scheduler as scheduler_module
from radixserve.cache.page_allocator import PageAllocator
from radixserve.cache.radix_cache import RadixCache
from radixserve.config import EngineConfig
from radixserve.sched.decode import DecodeRows
from radixserve.sched.scheduler import Scheduler
from radixserve.types import FinishReason, SamplingParams, TokenOutput
from tests.sched.test_scheduler import VOCAB, expected, fake_run


def wide_scheduler(max_running: int, pages: int = 4000) -> Scheduler:
    cfg = EngineConfig(page_size=1, max_running_requests=max_running,
                       max_prefill_tokens=max_running * 40, chunked_prefill_size=0)
    return Scheduler(cfg, PageAllocator(pages, 1), RadixCache(1), max_model_len=256,
                     vocab_size=VOCAB, eos_token_ids=(7,))


def test_admitting_many_requests_sums_the_reservation_once() -> None:
    """Each admission checks the tokens promised to every admitted request; the sum is kept
    as it grows, so one round of N admissions estimates each request's future tokens O(1)
    times (recomputing it per admission was O(N^2): ~N^2 / 2 estimates)."""
    n = 64
    s = wide_scheduler(n)
    calls = {"n": 0}
    real = s.mem.future_tokens

    def counted(req: object) -> int:
        calls["n"] += 1
        return real(req)  # type: ignore[arg-type]

    s.mem.future_tokens = counted  # type: ignore[method-assign]
    for i in range(n):
        s.add(f"r{i}", [i % (VOCAB - 1) + 1, 3, 5, 9], SamplingParams(max_tokens=4))
    batch = s.schedule()
    assert batch is not None and batch.size == n  # all admitted in one round
    assert calls["n"] <= 2 * n
    s.check_integrity()


def run(s: Scheduler, log: list[TokenOutput] | None = None
        ) -> tuple[dict[str, list[int]], dict[str, FinishReason], int]:
    """`log`: gets every output, in order."""
    got: dict[str, list[int]] = {}
    finish: dict[str, FinishReason] = {}
    plain_steps = 0
    while s.has_work():
        batch = s.schedule()
        assert batch is not None
        plain_steps += batch.rows is not None
        outs: list[TokenOutput] = s.process_outputs(batch, fake_run(batch))
        if log is not None:
            log += outs
        for o in outs:
            if o.token_id is not None:
                got.setdefault(o.rid, []).append(o.token_id)
            if o.finish_reason is not None:
                finish[o.rid] = o.finish_reason
        s.check_integrity()
    return got, finish, plain_steps


def add_mixed_stops(s: Scheduler) -> dict[str, list[int]]:
    """Requests whose stop rules differ: stop ids, EOS (7) honoured or ignored, min_tokens,
    lengths; returns the fake model's full continuation of each."""
    wants = {}
    for i in range(12):
        prompt = [i + 1, (3 * i) % (VOCAB - 1) + 1, 11]
        want = expected(prompt, 20)
        stop = (want[3 + i % 5],) if i % 3 == 0 else ()
        params = SamplingParams(temperature=0, max_tokens=6 + i, stop_token_ids=stop,
                                ignore_eos=i % 4 == 1, min_tokens=2 if i % 5 == 0 else 0)
        s.add(f"r{i}", prompt, params)
        wants[f"r{i}"] = want
    return wants


def test_vectorized_stop_test_equals_the_full_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    fast = wide_scheduler(16)
    wants = add_mixed_stops(fast)
    fast_log: list[TokenOutput] = []
    got, finish, plain_steps = run(fast, fast_log)
    assert plain_steps > 5  # the vectorized path ran
    # The same outputs through the general per-request loop (outputs.py takes it when the
    # running set changed since the step was planned, e.g. one step late under overlap).
    monkeypatch.setattr(scheduler_module.Scheduler, "running_version", property(lambda s: -1))
    general = wide_scheduler(16)
    add_mixed_stops(general)
    general_log: list[TokenOutput] = []
    assert run(general, general_log)[:2] == (got, finish)
    assert general_log == fast_log

    def every_request_exact(*args: object) -> DecodeRows:
        rows = build(*args)  # type: ignore[arg-type]
        return dataclasses.replace(rows, exact=np.ones(len(rows.reqs), dtype=bool))

    build = scheduler_module.build_rows
    monkeypatch.setattr(scheduler_module, "build_rows", every_request_exact)
    slow = wide_scheduler(16)
    add_mixed_stops(slow)
    assert run(slow)[:2] == (got, finish)
    reasons = set(finish.values())
    assert reasons == {FinishReason.STOP, FinishReason.LENGTH}
    for rid, tokens in got.items():
        assert tokens == wants[rid][: len(tokens)]


def test_a_step_without_logprobs_takes_the_vectorized_path(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    """The sampler hands a list of Nones when no request asks for logprobs (as the engine
    passes it on): that is the vectorized path too, with the same outputs."""
    from radixserve.sched import outputs

    calls = {"n": 0}
    live = outputs._live_outputs

    def counted(*args: Any) -> list[TokenOutput]:
        calls["n"] += 1
        return live(*args)

    monkeypatch.setattr(outputs, "_live_outputs", counted)
    logs: list[list[TokenOutput]] = []
    for with_nones in (False, True):
        s = wide_scheduler(16)
        add_mixed_stops(s)
        log: list[TokenOutput] = []
        plain = 0
        while s.has_work():
            batch = s.schedule()
            assert batch is not None
            tokens = fake_run(batch)
            plain += batch.rows is not None
            log += s.process_outputs(batch, tokens, [None] * len(tokens) if with_nones else None)
        logs.append(log)
    assert calls["n"] == 2 * plain > 0
    assert logs[0] == logs[1]


def test_decode_rows_persist_until_the_running_set_changes() -> None:
    s = wide_scheduler(8)
    for i, n in enumerate((3, 8, 8)):
        s.add(f"r{i}", [i + 1, 2, 3], SamplingParams(temperature=0, max_tokens=n,
                                                     ignore_eos=True))
    views = []
    while s.has_work():
        batch = s.schedule()
        assert batch is not None
        if batch.rows is not None:
            views.append((batch.rows, [r.rid for r in batch.rows.reqs]))
        s.process_outputs(batch, fake_run(batch))
    first, second = views[0][0], views[-1][0]
    assert views[0][1] == ["r0", "r1", "r2"] and views[-1][1] == ["r1", "r2"]
    # One object per running set: built again only once r0 finished.
    assert len({id(v) for v, _ in views}) == 2
    assert second.version > first.version
    assert first.rows != second.rows and len(second.rows) == 2


def test_the_sharing_test_compares_a_prompt_only_with_its_bucket(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """64 distinct 40-token prompts admitted in one round: each is compared with no chosen
    prompt (their first 32 tokens differ), where comparing with every chosen one was
    ~64^2 / 2 comparisons. Two prompts sharing 36 uncached tokens still wait a step."""
    import radixserve.sched.queue_policy as policy

    calls = {"n": 0}
    real = policy.common_prefix_len

    def counted(a: list[int], b: list[int]) -> int:
        calls["n"] += 1
        return real(a, b)

    monkeypatch.setattr(policy, "common_prefix_len", counted)
    s = wide_scheduler(80)
    for i in range(64):
        s.add(f"r{i}", [i % (VOCAB - 1) + 1, i // (VOCAB - 1) + 1] + [5] * 38,
              SamplingParams(max_tokens=2))
    s.add("twin", [1, 1] + [5] * 34 + [9, 9, 9, 9], SamplingParams(max_tokens=2))
    batch = s.schedule()
    assert batch is not None
    assert {r.rid for r in batch.reqs} == {f"r{i}" for i in range(64)}  # the twin waits
    assert calls["n"] == 1  # the twin against r0, its only bucket-mate
