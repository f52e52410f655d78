"""Mid-stream failover exact with stop strings and seeded sampling (router/proxy/stream_state.py
`continue_output_tokens`, radixserve/server/choice_stream.py): a real replica SIGKILLed while
8 streams sampled at temperature 0.8 are inside a stop string (the replica holds that text
back); each client's text equals the uninterrupted run's, cut at the stop string."""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

import aiohttp
import pytest

from tests.router.proxy.smollm2_fleet import Replicas, smollm2_fleet
from tests.sse import openai_chunks

MAX_TOKENS = 40
STOP_FROM, STOP_TO = 6, 36  # the stop string: the text of these output tokens
PROMPTS = [f"Tell me about the {thing} and why it matters. First," for thing in
           ("moon", "sea", "forest", "desert", "city", "river", "mountain", "sky")]


def request_for(i: int, stop: str | None) -> tuple[str, dict[str, Any]]:
    """Even: completions, odd: chat; seeded sampling at temperature 0.8."""
    common: dict[str, Any] = {"max_tokens": MAX_TOKENS, "temperature": 0.8, "seed": 1000 + i,
                              "ignore_eos": True, "stream": True}
    if stop is not None:
        common["stop"] = [stop, "@@never@@"]
    else:
        common["return_token_ids"] = True
    if i % 2 == 0:
        return "/v1/completions", {"prompt": PROMPTS[i], **common}
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": PROMPTS[i]}],
                                    **common}


@dataclasses.dataclass
class Seen:
    text: str = ""
    marks: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (ids, chars)
    finish: list[str] = dataclasses.field(default_factory=list)
    errors: list[Any] = dataclasses.field(default_factory=list)
    done: int = 0


async def collect(s: aiohttp.ClientSession, url: str, i: int, stop: str | None,
                  out: Seen) -> Seen:
    path, body = request_for(i, stop)
    num_ids = 0
    async with s.post(url + path, json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for event in openai_chunks(resp, out):
            for ch in event["choices"]:
                out.text += ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                num_ids += len(ch.get("token_ids", []))
                out.marks.append((num_ids, len(out.text)))
                if ch["finish_reason"]:
                    out.finish.append(ch["finish_reason"])
    return out


def stop_string(seen: Seen) -> tuple[str, int]:
    """The text of output tokens STOP_FROM..STOP_TO (chunk-aligned), and where it starts."""
    start = next(chars for ids, chars in seen.marks if ids >= STOP_FROM)
    end = next(chars for ids, chars in seen.marks if ids >= STOP_TO)
    stop = seen.text[start:end]
    assert stop.strip() and seen.text.find(stop) == start, (seen.text, start, end)
    return stop, start


@pytest.mark.slow
@pytest.mark.smollm2
@pytest.mark.timeout(900)
async def test_sigkill_inside_stop_strings_with_seeded_sampling(
        smollm2_replicas: Replicas) -> None:
    async with smollm2_fleet(smollm2_replicas) as f, aiohttp.ClientSession() as s:
        free = await f.each_alone(8, lambda url, i: collect(s, url, i, None, Seen()))
        stops = [stop_string(x) for x in free]
        want = await f.each_alone(8, lambda url, i: collect(s, url, i, stops[i][0], Seen()))
        for i, w in enumerate(want):  # the uninterrupted run stops where it should
            assert w.text == free[i].text[:stops[i][1]] and w.finish == ["stop"], i
        live = [Seen() for _ in range(8)]
        tasks = [asyncio.create_task(collect(s, f.url, i, stops[i][0], live[i]))
                 for i in range(8)]
        # Every stream has sent the text before its stop string: from here on its replica
        # holds back what it samples, until the stop string is complete.
        got = await f.kill_when(tasks, lambda: all(len(c.text) >= stops[i][1]
                                                   for i, c in enumerate(live)),
                                "every stream inside its stop string")
    for i, (w, have) in enumerate(zip(want, got, strict=True)):
        assert have.errors == [] and have.done == 1, (i, have.errors)
        assert have.text == w.text, (i, have.text, w.text)
        assert have.finish == ["stop"], (i, have.finish)
