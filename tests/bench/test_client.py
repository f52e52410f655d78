"""bench.serving against a fake streaming OpenAI server with known token timings (loopback)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson
import pytest
from aiohttp import web

from bench.common.client import ClientConfig, Endpoint, arrival_delays
from bench.common.workloads import (
    BenchRequest,
    Conversation,
    MultiTurnSpec,
    SharedPrefixSpec,
    Workload,
    WorkloadKind,
)
from bench.serving import run_benchmark

TTFT, ITL = 0.12, 0.04


@dataclass
class FakeState:
    bodies: list[dict[str, Any]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    hits: int = 0
    queries: int = 0
    reject_ignore_eos: bool = False
    eos_after: int | None = None  # stop early unless ignore_eos (a server that honours it)
    no_usage: bool = False  # a server that ignores stream_options.include_usage


STATE = web.AppKey("state", FakeState)


async def _completions(request: web.Request) -> web.StreamResponse:
    st: FakeState = request.app[STATE]
    body = await request.json()
    st.bodies.append(body)
    if st.reject_ignore_eos and "ignore_eos" in body:
        return web.json_response({"error": {"message": "unknown field ignore_eos"}}, status=400)
    prompt = body.get("prompt") or body["messages"][-1]["content"]
    if prompt.startswith("FAIL"):
        return web.json_response({"error": {"message": "boom"}}, status=500)
    n = body["max_tokens"]
    if st.eos_after is not None and not body.get("ignore_eos") and "logit_bias" not in body:
        n = min(n, st.eos_after)
    chat = "messages" in body
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    st.in_flight += 1
    st.max_in_flight = max(st.max_in_flight, st.in_flight)
    try:
        await asyncio.sleep(TTFT)
        for i in range(n):
            if i:
                await asyncio.sleep(ITL)
            if prompt.startswith("HANG") and i == 1:
                await asyncio.sleep(1.5)  # past the client's timeout
            if prompt.startswith("DROP") and i == 2:
                assert request.transport is not None
                request.transport.close()
                return resp
            choice = ({"index": 0, "delta": {"content": "t"}} if chat
                      else {"index": 0, "text": "t"})
            await resp.write(b"data: " + orjson.dumps({"choices": [choice]}) + b"\n\n")
        if st.no_usage:
            await resp.write(b"data: [DONE]\n\n")
            return resp
        cached = len(prompt) // 2
        st.hits += cached
        st.queries += len(prompt)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": n,
                 "prompt_tokens_details": {"cached_tokens": cached}}
        await resp.write(b"data: " + orjson.dumps({"choices": [], "usage": usage}) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
    except ConnectionResetError:  # the client gave up (its timeout): nothing to send to
        pass
    finally:
        st.in_flight -= 1
    return resp


async def _models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [{"id": "fake-model"}]})


async def _metrics(request: web.Request) -> web.Response:
    st: FakeState = request.app[STATE]
    return web.Response(text=f"radixserve:prefix_cache_hits_total {st.hits}\n"
                             f"radixserve:prefix_cache_queries_total {st.queries}\n")


@pytest.fixture
async def fake() -> AsyncIterator[tuple[str, FakeState]]:
    app = web.Application()
    app[STATE] = st = FakeState()
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _completions)
    app.router.add_get("/v1/models", _models)
    app.router.add_get("/metrics", _metrics)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}", st
    finally:
        await runner.cleanup()


def _workload(prompts: list[str], out: int = 5, warm: tuple[str, ...] = ("warm",)) -> Workload:
    reqs = tuple(BenchRequest(p, len(p), out) for p in prompts)
    return Workload(WorkloadKind.SHARED_PREFIX, SharedPrefixSpec(), 0, requests=reqs,
                    warmup_prompts=warm)


def _cfg(url: str, **kw: Any) -> ClientConfig:
    return ClientConfig(base_url=url, disable_tqdm=True, **kw)


async def test_measured_timings_match_the_server(fake: tuple[str, FakeState]) -> None:
    url, st = fake
    run = await run_benchmark(_cfg(url), _workload(["abcd" * 5] * 4, out=5))
    s = run.summary
    assert (s.completed, s.failed) == (4, 0) and run.model == "fake-model"
    assert s.total_output_tokens == 20 and s.total_prompt_tokens == 80
    tol = 0.06  # a shared 2-core machine: generous above, tight below (sleep never undershoots)
    assert TTFT - 0.01 <= s.ttft.p50 <= TTFT + tol
    assert ITL - 0.01 <= s.itl.p50 <= ITL + tol
    assert ITL - 0.01 <= s.tpot.mean <= ITL + tol
    assert s.itl.n == 4 * 4
    assert TTFT + 4 * ITL - 0.01 <= s.e2e.p50 <= TTFT + 4 * ITL + 2 * tol
    assert s.hit_rate == pytest.approx(0.5)
    assert s.server_hit_rate == pytest.approx(0.5)  # /metrics delta excludes the warm-up
    body = st.bodies[-1]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["max_tokens"] == 5 and body["model"] == "fake-model"
    assert st.bodies[0]["prompt"] == "warm"  # warm-up first, not counted
    assert len(run.results) == 4


async def test_failures_are_counted_not_raised(fake: tuple[str, FakeState]) -> None:
    url, _ = fake
    prompts = ["ok-1", "FAIL-a", "DROP-b", "HANG-c", "ok-2"]
    run = await run_benchmark(_cfg(url, timeout_s=0.8), _workload(prompts, out=4))
    s = run.summary
    assert (s.completed, s.failed) == (2, 3)
    errors = [r.error for r in run.results if not r.ok]
    assert any(e.startswith("HTTP 500") for e in errors)
    assert any(e.startswith(("ClientPayloadError", "ServerDisconnected", "no token"))
               for e in errors)
    assert any(e.startswith("TimeoutError") for e in errors)


async def test_unreachable_server_fails_requests(fake: tuple[str, FakeState]) -> None:
    # A closed port: the model name is given so the run reaches the requests themselves.
    cfg = _cfg("http://127.0.0.1:9", model="m", warmup=0, timeout_s=2.0)
    run = await run_benchmark(cfg, _workload(["a", "b"]))
    assert (run.summary.completed, run.summary.failed) == (0, 2)


async def test_max_concurrency_caps_in_flight(fake: tuple[str, FakeState]) -> None:
    url, st = fake
    run = await run_benchmark(_cfg(url, max_concurrency=2, warmup=0),
                              _workload([f"p{i}" for i in range(6)], out=2))
    assert run.summary.completed == 6
    assert st.max_in_flight == 2


async def test_rejected_ignore_eos_is_dropped_and_noted(fake: tuple[str, FakeState]) -> None:
    url, st = fake
    st.reject_ignore_eos, st.eos_after = True, 2
    run = await run_benchmark(_cfg(url), _workload(["x1", "x2"], out=6))
    assert run.summary.completed == 2 and run.config.ignore_eos is False
    assert "ignore_eos" not in st.bodies[-1]
    assert run.summary.short_outputs == 2
    assert any("rejected ignore_eos" in n for n in run.notes)
    assert any("does not honour ignore_eos" in n for n in run.notes)


async def test_extra_body_gives_exact_lengths_without_ignore_eos(
        fake: tuple[str, FakeState]) -> None:
    url, st = fake
    st.eos_after = 2
    ban = {"logit_bias": {"2": -100.0}}
    run = await run_benchmark(_cfg(url, ignore_eos=False, extra_body=ban),
                              _workload(["x1", "x2"], out=6))
    assert st.bodies[-1]["logit_bias"] == {"2": -100.0} and "ignore_eos" not in st.bodies[-1]
    assert run.summary.total_output_tokens == 12 and run.summary.short_outputs == 0


async def test_multi_turn_feeds_back_the_answer(fake: tuple[str, FakeState]) -> None:
    url, st = fake
    convs = (Conversation(("aa", "bb", "cc"), 3), Conversation(("dd", "ee", "ff"), 3))
    w = Workload(WorkloadKind.MULTI_TURN, MultiTurnSpec(), 0, conversations=convs,
                 warmup_prompts=("w",))
    run = await run_benchmark(_cfg(url, warmup=0), w)
    assert run.summary.completed == 6
    prompts = {b["prompt"] for b in st.bodies}
    assert {"aa", "aatttbb", "aatttbbtttcc", "dd", "ddtttee", "ddtttee" + "tttff"} == prompts
    # Turns of one conversation are sequential: each was sent after the previous one ended.
    first = [r for r in run.results if r.prompt_len == 2 and r.send_time < run.start_time + 0.05]
    assert len(first) == 2  # both conversations started at once


async def test_without_usage_tokens_are_counted_by_the_client(
        fake: tuple[str, FakeState]) -> None:
    url, st = fake
    st.no_usage = True
    convs = (Conversation(("aa", "bb"), 3),)
    w = Workload(WorkloadKind.MULTI_TURN, MultiTurnSpec(), 0, conversations=convs,
                 warmup_prompts=("w",), count_tokens=len)
    run = await run_benchmark(_cfg(url, warmup=0), w)
    assert [r.prompt_len for r in run.results] == [2, 7]  # "aa", "aa" + "ttt" + "bb"
    assert [r.output_len for r in run.results] == [3, 3]  # one chunk per token
    assert run.summary.hit_rate is None  # unknown, not 0


async def test_chat_endpoint_streams_deltas(fake: tuple[str, FakeState]) -> None:
    url, st = fake
    run = await run_benchmark(_cfg(url, endpoint=Endpoint.CHAT), _workload(["hello"], out=3))
    assert run.summary.completed == 1 and run.results[0].text == "ttt"
    assert st.bodies[-1]["messages"] == [{"role": "user", "content": "hello"}]


async def test_poisson_arrivals_spread_requests(fake: tuple[str, FakeState]) -> None:
    url, _ = fake
    run = await run_benchmark(_cfg(url, request_rate=20.0, warmup=0),
                              _workload([f"q{i}" for i in range(8)], out=1))
    sends = sorted(r.send_time for r in run.results)
    assert sends[-1] - sends[0] > 0.05  # not all at once


def test_arrival_delays_statistics() -> None:
    rng = np.random.default_rng(0)
    assert arrival_delays(3, math.inf, 1.0, rng) == [0.0, 0.0, 0.0]
    poisson = np.array(arrival_delays(20000, 4.0, 1.0, rng))
    assert poisson.mean() == pytest.approx(0.25, rel=0.05)
    assert poisson.std() / poisson.mean() == pytest.approx(1.0, rel=0.05)  # exponential: CV 1
    bursty = np.array(arrival_delays(20000, 4.0, 0.25, rng))
    assert bursty.mean() == pytest.approx(0.25, rel=0.08)
    assert bursty.std() / bursty.mean() == pytest.approx(2.0, rel=0.08)  # CV = 1/sqrt(shape)


def test_config_validation() -> None:
    with pytest.raises(ValueError):
        ClientConfig("http://x", request_rate=0)
    with pytest.raises(ValueError):
        ClientConfig("http://x", max_concurrency=0)
    with pytest.raises(ValueError):
        ClientConfig("http://x", burstiness=-1.0)
