"""The benchmark's HTTP side: request types, streamed sends, arrivals, conversations.

Request/run types, sending one streamed request, arrivals, multi-turn conversations, warm-up
and /metrics scraping.

Owns: the wire (aiohttp, SSE with `stream_options.include_usage`) and the arrival process
(all at once, Poisson / gamma with burstiness, a concurrency cap). Does not know: the CLI
(bench.serving), how workloads are built (bench.common.workloads), how figures are defined
(bench.common.metrics).
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import Enum
from typing import Any

import aiohttp
import numpy as np
import orjson
from tqdm.asyncio import tqdm

from bench.common.metrics import (
    BenchSummary,
    CounterHitRate,
    RequestResult,
    parse_prometheus,
)
from bench.common.workloads import (
    BenchRequest,
    Conversation,
    Workload,
)


class BenchError(RuntimeError):
    """The benchmark cannot run (server unreachable, no model name); not a request failure."""


class Endpoint(str, Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    model: str | None = None  # the served model name; None: the first of GET /v1/models
    endpoint: Endpoint = Endpoint.COMPLETIONS
    api_key: str | None = None
    request_rate: float = math.inf  # requests (or conversations) per second; inf: all at once
    burstiness: float = 1.0  # gamma shape of inter-arrival times; 1 is Poisson
    max_concurrency: int | None = None
    timeout_s: float = 600.0  # per request
    ignore_eos: bool = True
    # Merged into every request body, e.g. a logit_bias banning EOS where ignore_eos is unknown.
    extra_body: Mapping[str, Any] = field(default_factory=dict)
    warmup: int | None = None  # None: one request per warm-up prompt of the workload
    seed: int = 0
    disable_tqdm: bool = False

    def __post_init__(self) -> None:
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max_concurrency must be >= 1")
        if not self.timeout_s > 0:
            raise ValueError("timeout_s must be > 0")
        if self.warmup is not None and self.warmup < 0:
            raise ValueError("warmup must be >= 0")


@dataclass
class BenchRun:
    config: ClientConfig
    model: str
    workload: dict[str, Any]
    results: list[RequestResult]
    start_time: float
    summary: BenchSummary
    counters: CounterHitRate | None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        cfg = {k: jsonable(v) for k, v in vars(self.config).items() if k != "api_key"}
        t0 = self.start_time
        reqs = [{"ok": r.ok, "prompt_len": r.prompt_len, "output_len": r.output_len,
                 "cached_tokens": r.cached_tokens, "send": r.send_time - t0,
                 "ttft": r.ttft, "e2e": r.e2e, "itl": r.itls, "error": r.error}
                for r in self.results]
        return {"config": cfg, "model": self.model, "workload": self.workload,
                "summary": self.summary.to_dict(), "notes": self.notes, "requests": reqs}


def jsonable(v: Any) -> Any:
    """Enums by value, and inf as "inf" (JSON has no infinity; orjson would write null)."""
    if isinstance(v, Enum):
        return v.value
    return "inf" if isinstance(v, float) and math.isinf(v) else v


def arrival_delays(n: int, rate: float, burstiness: float, rng: np.random.Generator
                   ) -> list[float]:
    """Waits before each arrival: gamma(shape=burstiness, mean=1/rate); all zero at rate=inf."""
    if math.isinf(rate):
        return [0.0] * n
    return [float(x) for x in rng.gamma(burstiness, 1.0 / (rate * burstiness), n)]


def _headers(cfg: ClientConfig) -> dict[str, str]:
    return {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}


def _body(cfg: ClientConfig, model: str, prompt: str | list[dict[str, str]],
          max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    body.update(cfg.extra_body)
    if isinstance(prompt, str):
        body["prompt"] = prompt
    else:
        body["messages"] = prompt
    return body


def _read_usage(res: RequestResult, usage: dict[str, Any]) -> None:
    res.usage_reported = True
    res.prompt_len = int(usage.get("prompt_tokens", res.prompt_len))
    res.output_len = int(usage.get("completion_tokens", 0))
    details = usage.get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        res.cached_tokens = int(details["cached_tokens"])


async def send_request(session: aiohttp.ClientSession, cfg: ClientConfig, model: str,
                       prompt: str | list[dict[str, str]], prompt_len: int, max_tokens: int
                       ) -> RequestResult:
    """One streamed request; never raises for a server or network failure (ok=False)."""
    path = "chat/completions" if isinstance(prompt, list) else "completions"
    res = RequestResult(ok=False, send_time=time.perf_counter(), prompt_len=prompt_len,
                        expected_output_len=max_tokens)
    parts: list[str] = []
    try:
        async with session.post(f"{cfg.base_url}/v1/{path}", json=_body(cfg, model, prompt,
                                max_tokens), headers=_headers(cfg),
                                timeout=aiohttp.ClientTimeout(total=cfg.timeout_s)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == b"[DONE]":
                    break
                data = orjson.loads(payload)
                if "error" in data:
                    res.error = str(data["error"])[:300]
                    return res
                choices = data.get("choices") or []
                if choices:
                    c = choices[0]
                    text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    if text:
                        res.chunk_times.append(time.perf_counter())
                        parts.append(text)
                if data.get("usage"):
                    _read_usage(res, data["usage"])
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        res.error = f"{type(e).__name__}: {e}"[:300]
        return res
    res.end_time = time.perf_counter()
    res.text = "".join(parts)
    if not res.usage_reported:
        res.output_len = len(res.chunk_times)
    res.ok = bool(res.chunk_times) or max_tokens == 0
    if not res.ok:
        res.error = "no token streamed"
    return res


async def _limited(sem: asyncio.Semaphore | None, coro: Any) -> Any:
    if sem is None:
        return await coro
    async with sem:
        return await coro


async def _run_conversation(session: aiohttp.ClientSession, cfg: ClientConfig, model: str,
                            workload: Workload, conv: Conversation,
                            sem: asyncio.Semaphore | None, pbar: Any) -> list[RequestResult]:
    """Turns in order; each prompt = previous prompt + the server's answer + next message."""
    results: list[RequestResult] = []
    prompt, messages = "", []
    for i, msg in enumerate(conv.user_messages):
        prompt += msg
        messages.append({"role": "user", "content": msg})
        turn: str | list[dict[str, str]] = list(messages) if cfg.endpoint is Endpoint.CHAT \
            else prompt
        res = await _limited(sem, send_request(session, cfg, model, turn, 0, conv.output_len))
        if not res.usage_reported and workload.count_tokens is not None:
            res.prompt_len = workload.count_tokens(prompt)  # off the clock: the request is done
        results.append(res)
        pbar.update(1)
        if not res.ok:  # the conversation cannot go on without the answer
            skipped = len(conv.user_messages) - i - 1
            results += [RequestResult(False, res.send_time, 0, conv.output_len,
                                      error="an earlier turn failed") for _ in range(skipped)]
            pbar.update(skipped)
            break
        prompt += res.text
        messages.append({"role": "assistant", "content": res.text})
    return results


async def run_all(session: aiohttp.ClientSession, cfg: ClientConfig, model: str,
                   workload: Workload) -> list[RequestResult]:
    rng = np.random.default_rng(cfg.seed)
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    units: Sequence[BenchRequest | Conversation] = workload.requests or workload.conversations
    delays = arrival_delays(len(units), cfg.request_rate, cfg.burstiness, rng)
    pbar = tqdm(total=workload.num_requests, disable=cfg.disable_tqdm, desc="requests")
    tasks: list[asyncio.Task[Any]] = []
    for unit, delay in zip(units, delays, strict=True):
        if delay > 0:
            await asyncio.sleep(delay)
        if isinstance(unit, Conversation):
            coro: Any = _run_conversation(session, cfg, model, workload, unit, sem, pbar)
        else:
            prompt: str | list[dict[str, str]] = unit.prompt
            if cfg.endpoint is Endpoint.CHAT:
                prompt = [{"role": "user", "content": unit.prompt}]
            coro = _counted(pbar, _limited(sem, send_request(session, cfg, model, prompt,
                                                             unit.prompt_len, unit.output_len)))
        tasks.append(asyncio.create_task(coro))
    done = await asyncio.gather(*tasks)
    pbar.close()
    return [r for d in done for r in (d if isinstance(d, list) else [d])]


async def _counted(pbar: Any, coro: Any) -> RequestResult:
    res: RequestResult = await coro
    pbar.update(1)
    return res


async def fetch_model(session: aiohttp.ClientSession, cfg: ClientConfig) -> str:
    if cfg.model:
        return cfg.model
    try:
        async with session.get(f"{cfg.base_url}/v1/models", headers=_headers(cfg)) as resp:
            data = await resp.json(content_type=None)
            return str(data["data"][0]["id"])
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, ValueError) as e:
        raise BenchError(f"cannot read the model name from {cfg.base_url}/v1/models ({e}); "
                         "pass --served-model-name") from e


async def scrape_metrics(session: aiohttp.ClientSession, base_url: str) -> dict[str, float]:
    """Prometheus counters, or {} when the server has no /metrics."""
    try:
        async with session.get(f"{base_url}/metrics") as resp:
            return parse_prometheus(await resp.text()) if resp.status == 200 else {}
    except (aiohttp.ClientError, asyncio.TimeoutError):
        return {}


async def warm_up(session: aiohttp.ClientSession, cfg: ClientConfig, model: str,
                   workload: Workload, notes: list[str]) -> ClientConfig:
    """Send the warm-up requests; drop ignore_eos if the server rejects the field."""
    n = len(workload.warmup_prompts) if cfg.warmup is None else cfg.warmup
    prompts = list(workload.warmup_prompts) or ["Warm-up."]
    out_len = (workload.requests or workload.conversations)[0].output_len
    for i in range(n):
        prompt: str | list[dict[str, str]] = prompts[i % len(prompts)]
        if cfg.endpoint is Endpoint.CHAT:
            prompt = [{"role": "user", "content": str(prompt)}]
        res = await send_request(session, cfg, model, prompt, 0, out_len)
        if not res.ok and cfg.ignore_eos and res.error.startswith(("HTTP 400", "HTTP 422")):
            cfg = replace(cfg, ignore_eos=False)
            notes.append(f"server rejected ignore_eos ({res.error[:120]}); sent without it")
            res = await send_request(session, cfg, model, prompt, 0, out_len)
        if not res.ok:
            raise BenchError(f"warm-up request failed: {res.error}")
    if n:
        notes.append(f"warm-up: {n} request(s) carrying the workload's shared prefix(es)")
    return cfg

