"""A soak load for a real server: a mix of streaming, non-streaming, aborted, disconnected,
timed-out and bad requests over shared prefixes, with counts by outcome and RSS samples.

Owns: the load and its report. Does not know: how the server was started (the caller passes
its URL, key and process ids) or what the caller asserts.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import orjson

SYSTEM = "You are a careful assistant. Answer briefly. " * 3
EXPECTED = {"ok_stream", "ok_json", "aborted_stream", "disconnected", "rejected_4xx",
            "timeout_408", "busy_429"}


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


@dataclass
class SoakReport:
    outcomes: Counter[str] = field(default_factory=Counter)
    rss_start: dict[str, float] = field(default_factory=dict)  # after warm-up
    rss_end: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def num_requests(self) -> int:
        return sum(self.outcomes.values())

    @property
    def unexpected(self) -> dict[str, int]:
        return {k: v for k, v in self.outcomes.items() if k not in EXPECTED}

    def line(self) -> str:
        rss = ", ".join(f"{k} {self.rss_start[k]:.0f}->{self.rss_end[k]:.0f} MiB"
                        for k in self.rss_start)
        return (f"soak: {self.num_requests} requests in {self.seconds:.0f}s, "
                f"{dict(sorted(self.outcomes.items()))}; RSS {rss}")


def _body(rng: random.Random, kind: str) -> tuple[str, bytes]:
    prompt = SYSTEM + f"Question {rng.randrange(1000)}: what is {rng.randrange(100)}?"
    common = {"max_tokens": rng.randint(2, 16), "temperature": rng.choice([0, 0.7])}
    if kind == "bad":
        return rng.choice([
            ("/v1/completions", b"{not json"),
            ("/v1/completions", orjson.dumps({"prompt": prompt, "max_tokens": -3})),
            ("/v1/chat/completions", orjson.dumps({"messages": "hi"})),
            ("/generate", orjson.dumps({"text": prompt, "sampling_params": {"bogus": 1}})),
            ("/v1/completions", orjson.dumps({"prompt": [10**12]})),
        ])
    if kind == "timeout":
        common.update(max_tokens=16, timeout=rng.choice([0.001, 0.05]))
    if rng.random() < 0.5:
        return "/v1/chat/completions", orjson.dumps(
            {"messages": [{"role": "system", "content": SYSTEM},
                          {"role": "user", "content": prompt[-40:]}], **common})
    return "/v1/completions", orjson.dumps({"prompt": prompt, "n": rng.choice([1, 1, 2]),
                                            **common})


def _classify_json(status: int) -> str:
    if status == 200:
        return "ok_json"
    if status == 408:
        return "timeout_408"
    if status == 429:
        return "busy_429"
    return "rejected_4xx" if 400 <= status < 500 else f"http_{status}"


async def _one(session: aiohttp.ClientSession, url: str, rng: random.Random) -> str:
    kind = rng.choices(["stream", "json", "abort", "disconnect", "bad", "timeout"],
                       [30, 20, 15, 10, 15, 10])[0]
    path, raw = _body(rng, kind)
    if kind in ("stream", "abort", "timeout") and rng.random() < 0.7:
        raw = orjson.dumps({**orjson.loads(raw), "stream": True})
    if kind == "disconnect":  # the client gives up before the answer: the server aborts
        try:
            resp = await asyncio.wait_for(session.post(url + path, data=raw),
                                          rng.uniform(0.001, 0.2))
        except asyncio.TimeoutError:
            return "disconnected"
        async with resp:
            await resp.read()
            return _classify_json(resp.status)
    async with session.post(url + path, data=raw) as resp:
        if not resp.content_type.startswith("text/event-stream"):
            await resp.read()
            return _classify_json(resp.status)
        if kind == "abort":
            await resp.content.readline()
            resp.close()
            return "aborted_stream"
        text = await resp.text()
        if '"error"' in text:
            return "timeout_408" if "request_timeout" in text else "stream_error_event"
        return "ok_stream" if text.endswith("data: [DONE]\n\n") else "stream_truncated"


async def soak(url: str, key: str | None, pids: dict[str, int], duration_s: float,
               concurrency: int = 8, seed: int = 0) -> SoakReport:
    """Keep `concurrency` requests in flight for `duration_s` seconds. RSS is sampled after
    the first fifth (warm-up: caches, allocator arenas) and at the end."""
    report = SoakReport()
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    timeout = aiohttp.ClientTimeout(total=120)
    start = time.monotonic()
    warm_until = start + duration_s / 5

    async def worker(i: int, session: aiohttp.ClientSession) -> None:
        rng = random.Random(seed * 1000 + i)
        while time.monotonic() - start < duration_s:
            try:
                outcome = await _one(session, url, rng)
            except (aiohttp.ClientError, asyncio.TimeoutError) as err:
                outcome = f"client_error:{type(err).__name__}"
            report.outcomes[outcome] += 1
            if not report.rss_start and time.monotonic() >= warm_until:
                report.rss_start = {name: rss_mib(pid) for name, pid in pids.items()}

    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as session:
        await asyncio.gather(*(worker(i, session) for i in range(concurrency)))
    report.seconds = time.monotonic() - start
    if not report.rss_start:
        report.rss_start = {name: rss_mib(pid) for name, pid in pids.items()}
    report.rss_end = {name: rss_mib(pid) for name, pid in pids.items()}
    return report
