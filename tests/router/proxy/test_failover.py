"""Mid-stream failover (router/proxy/resume.py, router/proxy/stream_state.py): a stream whose replica dies
continues on another one, token-identical; when it cannot, it ends with an SSE error event and
[DONE], never silently. The e2e part runs real `radixserve serve` replicas (SmolLM2, fp32)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import Any

import aiohttp
import aiohttp.web
import orjson
import pytest

from radixserve.testing.fake_replica import FakeReplicaConfig, fake_cluster, start_app
from router.app import ROUTER_KEY, create_app
from router.config import RouterConfig
from router.proxy.stream_state import why_not_resumable
from router.routing.route_key import RequestKind
from tests.router.proxy.smollm2_fleet import Replicas, smollm2_fleet
from tests.sse import openai_chunks
from tests.waiting import wait_until

FAST = RouterConfig(health_interval_s=0.05, health_timeout_s=1.0, retry_backoff_s=0.01)


async def raw_events(s: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> list[bytes]:
    """Every `data:` payload the client receives, up to the end or a broken connection."""
    payloads = []
    with contextlib.suppress(aiohttp.ClientPayloadError):
        async with s.post(f"{url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            async for line in resp.content:
                if line.startswith(b"data: "):
                    payloads.append(line[6:].strip())
    return payloads


def assert_error_then_done(payloads: list[bytes]) -> None:
    assert payloads[-1] == b"[DONE]" and payloads.count(b"[DONE]") == 1
    error = orjson.loads(payloads[-2])["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == "stream_interrupted" and error["type"] == "server_error"


@pytest.mark.timeout(60)
def test_what_can_be_resumed_exactly() -> None:
    plain = {"prompt": "x", "stream": True, "max_tokens": 5, "temperature": 0, "seed": 3,
             "stop": ["\n"], "prompt_cache_key": "k", "stream_options": {"include_usage": True}}
    assert why_not_resumable(RequestKind.COMPLETIONS, plain) is None
    chat = {"messages": [], "tools": [{"type": "function"}], "tool_choice": "none"}
    assert why_not_resumable(RequestKind.CHAT, chat) is None
    for extra in ({"n": 3}, {"logprobs": 2}):
        assert why_not_resumable(RequestKind.COMPLETIONS, {**plain, **extra}) is None
    assert why_not_resumable(RequestKind.CHAT, {"logprobs": True, "top_logprobs": 2}) is None
    for extra in ({"echo": True}, {"presence_penalty": 0.5},
                  {"response_format": {"type": "json_object"}}, {"guided_regex": "a+"},
                  {"tools": [{"type": "function"}]}, {"prompt": ["a", "b"]}):
        assert why_not_resumable(RequestKind.COMPLETIONS, {**plain, **extra}) is not None, extra


@pytest.mark.timeout(60)
@pytest.mark.parametrize("max_resumes", [0, 1])
async def test_a_stream_that_cannot_resume_ends_with_an_error_event(max_resumes: int) -> None:
    # Fake replicas send no token ids: with or without resumes allowed, nothing to resume from.
    cfg = dataclasses.replace(FAST, max_resumes=max_resumes)
    rcfg = [FakeReplicaConfig(name=f"r{i}", decode_s_per_token=0.01) for i in range(2)]
    async with fake_cluster(cfg, rcfg) as c, aiohttp.ClientSession() as s:
        for r in c.replicas:
            r.break_after_chunks = 2
        payloads = await raw_events(s, c.url, {"prompt": "x", "stream": True, "max_tokens": 5})
        assert len(payloads) == 4  # two chunks, the error, [DONE]
        assert_error_then_done(payloads)
        router = c.router_app[ROUTER_KEY]
        assert router.stream_counts == {"resumed": 0, "failed": 1}
        async with s.get(f"{c.url}/workers") as resp:
            states = [w["state"] for w in (await resp.json())["workers"]]
        assert sorted(states) == ["closed", "open"]  # the broken stream counts as a fault


@pytest.mark.timeout(60)
async def test_a_stalled_stream_counts_against_its_worker() -> None:
    cfg = dataclasses.replace(FAST, stream_stall_timeout_s=0.3)
    rcfg = [FakeReplicaConfig(name="slow", decode_s_per_token=5.0)]
    async with fake_cluster(cfg, rcfg) as c, aiohttp.ClientSession() as s:
        payloads = await raw_events(s, c.url, {"prompt": "x", "stream": True, "max_tokens": 3})
        assert_error_then_done(payloads)
        assert b"stalled" in payloads[-2]
        worker = c.router_app[ROUTER_KEY].pool.get(c.replicas[0].url)
        assert worker is not None and worker.num_errors == 1 and worker.trips == 1


# --- end to end: SIGKILL a real replica while 8 greedy streams are mid-way ------------------

PROMPTS = [f"Write a long story about a {animal} who learns to {verb}. Once upon a time,"
           for animal, verb in [("cat", "sing"), ("dog", "paint"), ("fox", "swim"),
                                ("owl", "cook"), ("bee", "dance"), ("cow", "read"),
                                ("eel", "fly"), ("ant", "sail")]]
MAX_TOKENS = 40


def request_for(i: int) -> tuple[str, dict[str, Any]]:
    """Even: completions, odd: chat; i % 4 < 2 asks for token ids itself."""
    common = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
              "stream_options": {"include_usage": True}, "return_token_ids": True}
    if i % 4 >= 2:
        del common["return_token_ids"]
    if i % 2 == 0:
        return "/v1/completions", {"prompt": PROMPTS[i], **common}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[i]}],
                                    **common}


class Collected:
    def __init__(self) -> None:
        self.text, self.ids, self.chunk_ids, self.created = "", [], set(), set()
        self.usage: dict[str, Any] | None = None
        self.finish: list[str] = []
        self.done = 0
        self.errors: list[Any] = []
        self.num_chunks = 0


async def collect(s: aiohttp.ClientSession, url: str, i: int, out: Collected) -> Collected:
    path, body = request_for(i)
    async with s.post(url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for event in openai_chunks(resp, out):
            out.chunk_ids.add(event["id"])
            out.created.add(event["created"])
            out.usage = event.get("usage") or out.usage
            for ch in event["choices"]:
                out.num_chunks += 1
                out.text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                out.ids += ch.get("token_ids", [])
                assert ("token_ids" in ch) == ("return_token_ids" in body) or \
                    "prompt_token_ids" in ch
                if ch["finish_reason"]:
                    out.finish.append(ch["finish_reason"])
    return out


@pytest.mark.slow
@pytest.mark.smollm2
@pytest.mark.timeout(900)
async def test_sigkill_mid_stream_resumes_eight_streams_token_identically(
        smollm2_replicas: Replicas) -> None:
    async with smollm2_fleet(smollm2_replicas) as f, aiohttp.ClientSession() as s:
        reference = await f.each_alone(8, lambda url, i: collect(s, url, i, Collected()))
        live = [Collected() for _ in range(8)]
        tasks = [asyncio.create_task(collect(s, f.url, i, live[i])) for i in range(8)]
        await wait_until(lambda: all(c.num_chunks >= 6 for c in live), timeout=300,
                         what="every stream mid-way")
        assert all(not c.finish for c in live)
        victim = f.kill_busiest()
        got = await asyncio.gather(*tasks)
        assert f.router.stream_counts["resumed"] == victim.num_errors >= 1
        assert f.router.stream_counts["failed"] == 0
    for i, (want, have) in enumerate(zip(reference, got, strict=True)):
        assert have.errors == [] and have.done == 1, (i, have.errors)
        assert have.text == want.text, (i, have.text, want.text)
        if i % 4 < 2:
            assert have.ids == want.ids and len(have.ids) == MAX_TOKENS, i
        assert len(have.chunk_ids) == 1 and len(have.created) == 1, i  # one stream
        assert have.finish == ["length"], (i, have.finish)
        assert have.usage is not None and want.usage is not None
        assert have.usage["completion_tokens"] == MAX_TOKENS
        assert have.usage["prompt_tokens"] == want.usage["prompt_tokens"]


class Breaking:
    """Streams completions with token ids, breaking after `chunks`; /generate (the resume)
    answers 500 or streams the rest as the native route does."""

    def __init__(self, chunks: int, resume_status: int) -> None:
        self.chunks, self.resume_status = chunks, resume_status
        self.resumes: list[dict[str, Any]] = []
        self.app = aiohttp.web.Application()
        self.app.router.add_post("/v1/completions", self._stream)
        self.app.router.add_post("/generate", self._generate)
        self.app.router.add_get("/health", self._health)

    async def _health(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response({"status": "ok"})

    async def _stream(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        body = await request.json()
        assert body["return_token_ids"] is True
        resp = aiohttp.web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(self.chunks):
            choice = {"index": 0, "text": f"t{i} ", "logprobs": None, "finish_reason": None,
                      "token_ids": [100 + i]}
            if i == 0:
                choice["prompt_token_ids"] = [1, 2, 3]
            event = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m",
                     "choices": [choice]}
            await resp.write(b"data: " + orjson.dumps(event) + b"\n\n")
        assert request.transport is not None
        request.transport.abort()  # the replica dies mid-stream
        return resp

    async def _generate(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        self.resumes.append(await request.json())
        if self.resume_status != 200:
            return aiohttp.web.json_response({"error": {"message": "dead", "type": "server_error",
                                                        "param": None, "code": None}},
                                             status=self.resume_status)
        resp = aiohttp.web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        ids: list[int] = []
        for i in range(2):
            ids.append(200 + i)
            fin = {"type": "length"} if i == 1 else None
            event = {"text": "".join(f"u{j} " for j in range(i + 1)), "output_ids": ids,
                     "meta_info": {"finish_reason": fin, "cached_tokens": 3}}
            await resp.write(b"data: " + orjson.dumps(event) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


async def through_fakes(fakes: list[Breaking], body: dict[str, Any]) -> list[bytes]:
    """`body` streamed through a router in front of `fakes`: what the client receives."""
    started = [await start_app(f.app) for f in fakes]
    cfg = dataclasses.replace(FAST, workers=tuple(u for _, u in started), health_interval_s=5.0)
    runner, url = await start_app(create_app(cfg))
    try:
        async with aiohttp.ClientSession() as s:
            return await raw_events(s, url, body)
    finally:
        await runner.cleanup()
        for r, _ in started:
            await r.cleanup()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("resume_status", [200, 500])
async def test_resume_continues_the_stream_or_ends_it_with_an_error(resume_status: int) -> None:
    fakes = [Breaking(3, resume_status) for _ in range(2)]
    body = {"prompt": "x", "stream": True, "max_tokens": 5, "temperature": 0, "seed": 9,
            "stream_options": {"include_usage": True}}
    payloads = await through_fakes(fakes, body)
    resumed = [r for f in fakes for r in f.resumes]
    assert len(resumed) == 1  # --max-resumes 1: one try
    assert resumed[0] == {"input_ids": [1, 2, 3, 100, 101, 102], "stream": True,
                          "continue_output_tokens": 3,
                          "sampling_params": {"temperature": 0, "seed": 9, "max_new_tokens": 2}}
    events = [orjson.loads(p) for p in payloads[:-1]]
    assert payloads[-1] == b"[DONE]"
    if resume_status != 200:
        assert_error_then_done(payloads)
        return
    assert all(e["id"] == "cmpl-1" and e["created"] == 7 for e in events)
    assert all("token_ids" not in c and "prompt_token_ids" not in c
               for e in events for c in e["choices"])  # the router's, not the client's
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == "t0 t1 t2 u0 u1 "
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert events[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8,
                                   "prompt_tokens_details": {"cached_tokens": 3}}
