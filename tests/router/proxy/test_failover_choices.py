"""Failover with `n` > 1 (router/proxy/stream_state.py, resume.py): every unfinished choice
continues on its own, seeded as the replica seeds choice i (seed + i), token ids and finish
kept per choice; a finished choice is not continued. The e2e part SIGKILLs a real replica
(SmolLM2, fp32) under streams of 2 seeded choices each."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import aiohttp
import aiohttp.web
import orjson
import pytest

from router.config import RouterConfig
from tests.router.proxy.smollm2_fleet import Replicas, smollm2_fleet
from tests.router.proxy.test_failover import Breaking, through_fakes
from tests.sse import openai_chunks

FAST = RouterConfig(health_interval_s=5.0, health_timeout_s=1.0, retry_backoff_s=0.01)


class ThreeChoices(Breaking):
    """Streams n=3 completions: choice 0 gets 2 tokens, choice 1 finishes (stop) after 1,
    choice 2 gets 1; then dies. /generate continues as Breaking's does (2 tokens)."""

    def __init__(self) -> None:
        super().__init__(chunks=0, resume_status=200)

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


@pytest.mark.timeout(60)
async def test_each_unfinished_choice_continues_with_its_own_seed() -> None:
    fakes = [ThreeChoices() for _ in range(2)]
    body = {"prompt": "x", "stream": True, "max_tokens": 4, "n": 3, "seed": 7,
            "temperature": 0.8, "stream_options": {"include_usage": True}}
    payloads = await through_fakes(fakes, body)
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
    assert text == {0: "a0 a1 u0 u1 ", 1: "b0", 2: "c0 u0 u1 "}
    assert finish == {0: ["length"], 1: ["stop"], 2: ["length"]}
    assert events[-1]["usage"]["completion_tokens"] == 4 + 1 + 3


# --- end to end: SIGKILL a real replica while 4 streams of n = 2 seeded choices run ----------

PROMPTS = [f"Describe a {thing} in detail. It" for thing in ("castle", "ship", "garden", "storm")]
MAX_TOKENS = 30


def body_for(i: int) -> tuple[str, dict[str, Any]]:
    common: dict[str, Any] = {"max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": 50 + i,
                              "n": 2, "ignore_eos": True, "stream": True}
    if i % 2 == 0:
        return "/v1/completions", {"prompt": PROMPTS[i], "logprobs": 2, **common}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[i]}],
                                    "logprobs": True, "top_logprobs": 2, **common}


@dataclasses.dataclass
class PerChoice:
    text: dict[int, str] = dataclasses.field(default_factory=dict)
    finish: dict[int, list[str]] = dataclasses.field(default_factory=dict)
    errors: list[Any] = dataclasses.field(default_factory=list)
    done: int = 0
    # Per choice, per token: (token, logprob, text_offset or None, alternatives).
    logprobs: dict[int, list[tuple[str, float, int | None, frozenset[str]]]] = \
        dataclasses.field(default_factory=dict)

    def add_logprobs(self, index: int, lp: dict[str, Any] | None) -> None:
        rows = self.logprobs.setdefault(index, [])
        if lp is None:
            return
        if "content" in lp:  # chat
            rows += [(e["token"], e["logprob"], None,
                      frozenset(t["token"] for t in e["top_logprobs"])) for e in lp["content"]]
            return
        rows += [(tok, value, offset, frozenset(top or ())) for tok, value, offset, top in zip(
            lp["tokens"], lp["token_logprobs"], lp["text_offset"], lp["top_logprobs"],
            strict=True)]


async def collect(s: aiohttp.ClientSession, url: str, i: int, out: PerChoice) -> PerChoice:
    path, body = body_for(i)
    async with s.post(url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for event in openai_chunks(resp, out):
            for ch in event["choices"]:
                piece = ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                out.text[ch["index"]] = out.text.get(ch["index"], "") + piece
                out.add_logprobs(ch["index"], ch.get("logprobs"))
                if ch["finish_reason"]:
                    out.finish.setdefault(ch["index"], []).append(ch["finish_reason"])
    return out


@pytest.mark.slow
@pytest.mark.smollm2
@pytest.mark.timeout(900)
async def test_sigkill_mid_stream_with_two_seeded_choices_and_logprobs(
        smollm2_replicas: Replicas) -> None:
    async with smollm2_fleet(smollm2_replicas) as f, aiohttp.ClientSession() as s:
        want = await f.each_alone(4, lambda url, i: collect(s, url, i, PerChoice()))
        live = [PerChoice() for _ in range(4)]
        tasks = [asyncio.create_task(collect(s, f.url, i, live[i])) for i in range(4)]
        got = await f.kill_when(tasks, lambda: all(len(c.text.get(k, "")) >= 20
                                                   for c in live for k in (0, 1)),
                                "every choice mid-way")
    for i, (w, have) in enumerate(zip(want, got, strict=True)):
        assert have.errors == [] and have.done == 1, (i, have.errors)
        assert have.text == w.text and len(w.text) == 2, (i, have.text, w.text)
        assert have.finish == {0: ["length"], 1: ["length"]}, (i, have.finish)
        for k in (0, 1):  # the same tokens, offsets and alternatives; values up to numerics
            mine, ref = have.logprobs[k], w.logprobs[k]
            assert len(ref) == MAX_TOKENS and [(t, o, a) for t, _, o, a in mine] == \
                [(t, o, a) for t, _, o, a in ref], (i, k)
            assert all(abs(a[1] - b[1]) < 1e-3 for a, b in zip(mine, ref, strict=True))
