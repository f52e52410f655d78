"""Failover with `n` > 1 (router/proxy/stream_state.py, resume.py): every unfinished choice
continues on its own, seeded as the replica seeds choice i (seed + i), token ids and finish
kept per choice; a finished choice is not continued."""

from __future__ import annotations

import dataclasses
from typing import Any

import aiohttp.web
import orjson
import pytest

from radixserve.testing.fake_replica import start_app
from router.app import create_app
from router.config import RouterConfig
from tests.router.proxy.test_failover import raw_events

FAST = RouterConfig(health_interval_s=5.0, health_timeout_s=1.0, retry_backoff_s=0.01)


class ThreeChoices:
    """Streams n=3 completions: choice 0 gets 2 tokens, choice 1 finishes (stop) after 1,
    choice 2 gets 1; then dies. /generate continues whatever it is asked, 2 tokens."""

    def __init__(self) -> None:
        self.resumes: list[dict[str, Any]] = []
        self.app = aiohttp.web.Application()
        self.app.router.add_post("/v1/completions", self._stream)
        self.app.router.add_post("/generate", self._generate)
        self.app.router.add_get("/health", self._health)

    async def _health(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.json_response({"status": "ok"})

    async def _stream(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        resp = aiohttp.web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        script = [(0, "a0 ", 100, None), (1, "b0", 200, "stop"), (2, "c0 ", 300, None),
                  (0, "a1 ", 101, None)]
        for k, (index, text, token, finish) in enumerate(script):
            choice: dict[str, Any] = {"index": index, "text": text, "logprobs": None,
                                      "finish_reason": finish, "token_ids": [token]}
            if k < 3:
                choice["prompt_token_ids"] = [1, 2]
            event = {"id": "cmpl-9", "object": "text_completion", "created": 5, "model": "m",
                     "choices": [choice]}
            await resp.write(b"data: " + orjson.dumps(event) + b"\n\n")
        assert request.transport is not None
        request.transport.abort()
        return resp

    async def _generate(self, request: aiohttp.web.Request) -> aiohttp.web.StreamResponse:
        body = await request.json()
        self.resumes.append(body)
        resp = aiohttp.web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        base = body["input_ids"][-1] + 1
        ids: list[int] = []
        for i in range(body["sampling_params"]["max_new_tokens"]):
            ids.append(base + i)
            last = i == body["sampling_params"]["max_new_tokens"] - 1
            event = {"text": "".join(f"r{t} " for t in ids), "output_ids": ids,
                     "meta_info": {"finish_reason": {"type": "length"} if last else None}}
            await resp.write(b"data: " + orjson.dumps(event) + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp


@pytest.mark.timeout(60)
async def test_each_unfinished_choice_continues_with_its_own_seed() -> None:
    fakes = [ThreeChoices() for _ in range(2)]
    started = [await start_app(f.app) for f in fakes]
    cfg = dataclasses.replace(FAST, workers=tuple(u for _, u in started))
    runner, url = await start_app(create_app(cfg))
    body = {"prompt": "x", "stream": True, "max_tokens": 4, "n": 3, "seed": 7,
            "temperature": 0.8, "stream_options": {"include_usage": True}}
    try:
        async with aiohttp.ClientSession() as s:
            payloads = await raw_events(s, url, body)
    finally:
        await runner.cleanup()
        for r, _ in started:
            await r.cleanup()
    resumes = [r for f in fakes for r in f.resumes]
    assert [(r["input_ids"], r["continue_output_tokens"], r["sampling_params"]["seed"],
             r["sampling_params"]["max_new_tokens"]) for r in resumes] == [
        ([1, 2, 100, 101], 2, 7, 2),  # choice 0: seed as sent
        ([1, 2, 300], 1, 9, 3),  # choice 2: seed + 2; choice 1 had finished
    ]
    assert payloads[-1] == b"[DONE]"
    events = [orjson.loads(p) for p in payloads[:-1]]
    assert all(e["id"] == "cmpl-9" and "error" not in e for e in events)
    text: dict[int, str] = {}
    finish: dict[int, list[str]] = {}
    for e in events:
        for c in e["choices"]:
            text[c["index"]] = text.get(c["index"], "") + c["text"]
            if c["finish_reason"]:
                finish.setdefault(c["index"], []).append(c["finish_reason"])
            assert "token_ids" not in c and "prompt_token_ids" not in c
    assert text == {0: "a0 a1 r102 r103 ", 1: "b0", 2: "c0 r301 r302 r303 "}
    assert finish == {0: ["length"], 1: ["stop"], 2: ["length"]}
    assert events[-1]["usage"]["completion_tokens"] == 4 + 1 + 4
