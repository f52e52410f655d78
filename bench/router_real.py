"""The pressure trace end to end on real replicas: does precise routing hold up on a model?

    python -m bench.router_real [--model smollm2-135m --replicas 2 --kv-cache-tokens 2048]

Starts `--replicas` real `radixserve serve` processes (fp32, one thread each, a small KV cache
so that the tenants' prefixes overflow it, /kv_events on), then for round_robin, cache_aware
(approximate) and cache_aware + kv events (precise, tokenizing with the replicas' tokenizer)
in turn: flushes every replica's cache, runs bench/common/router_trace.py's multi-tenant trace
through an in-process router, and reports throughput, TTFT p50/p90 and the prefix hit rate
(cached / prompt tokens from `usage`). Figures in bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import time
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import numpy as np

from bench.common.router_trace import TraceConfig, pressure_trace
from bench.router import one_stream
from radixserve.testing.fake_replica import start_app
from router.app import create_app
from router.config import PolicyName, RouterConfig
from router.routing.route_key import load_prompt_encoder
from tests.server_proc import running_server

SCENARIOS = [("round_robin", PolicyName.ROUND_ROBIN, False),
             ("cache_aware", PolicyName.CACHE_AWARE, False),
             ("cache_aware + kv events", PolicyName.CACHE_AWARE, True)]


async def _load(s: aiohttp.ClientSession, url: str, prompts: list[str], concurrency: int,
                max_tokens: int) -> list[tuple[float, int, int]]:
    sem = asyncio.Semaphore(concurrency)

    async def one(p: str) -> tuple[float, int, int]:
        async with sem:
            return await one_stream(s, url, p, max_tokens, model=None)

    return await asyncio.gather(*(one(p) for p in prompts))


async def run(urls: Sequence[str], model: str, prompts: list[str], concurrency: int,
              max_tokens: int, only: str | None = None
              ) -> list[tuple[str, float, float, float, float]]:
    encoder = load_prompt_encoder(model)
    rows = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        for name, policy, kv in SCENARIOS:
            if only is not None and name != only:
                continue
            for u in urls:
                async with s.post(f"{u}/flush_cache") as resp:
                    assert resp.status == 200, await resp.text()
            cfg = RouterConfig(workers=tuple(urls), policy=policy, kv_events=kv,
                               health_interval_s=1.0)
            runner, url = await start_app(create_app(cfg, encoder=encoder))
            try:
                await asyncio.sleep(1.0)  # kv event streams connect
                start = time.perf_counter()
                got = await _load(s, url, prompts, concurrency, max_tokens)
                wall = time.perf_counter() - start
            finally:
                await runner.cleanup()
            ttft = np.array([g[0] for g in got]) * 1e3
            rows.append((name, len(prompts) / wall, float(np.percentile(ttft, 50)),
                         float(np.percentile(ttft, 90)),
                         sum(g[1] for g in got) / sum(g[2] for g in got)))
            print(rows[-1], flush=True)
    return rows


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--kv-cache-tokens", type=int, default=2048)
    p.add_argument("--tenants", type=int, default=16)
    p.add_argument("--requests", type=int, default=96)
    p.add_argument("--prefix-len", type=int, default=1200, help="characters")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--logs", default="bench/results/router_real_logs")
    p.add_argument("--only", choices=[x[0] for x in SCENARIOS], default=None)
    args = p.parse_args(argv)
    trace = TraceConfig(tenants=args.tenants, requests=args.requests,
                        prefix_len=args.prefix_len, suffix_len=40)
    prompts = pressure_trace(trace, random.Random(0))
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    serve_args = ["--kv-cache-tokens", str(args.kv_cache_tokens), "--max-model-len", "1024",
                  "--enable-kv-events"]
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(running_server(args.model, logs / f"r{i}.log",
                                                      serve_args))
                   for i in range(args.replicas)]
        rows = asyncio.run(run([x.url for x in servers], args.model, prompts,
                               args.concurrency, args.max_tokens, args.only))
    print("| policy | throughput (req/s) | TTFT p50 (ms) | TTFT p90 (ms) | hit rate |")
    print("|---|---|---|---|---|")
    for name, thr, p50, p90, hit in rows:
        print(f"| {name} | {thr:.2f} | {p50:.0f} | {p90:.0f} | {hit:.3f} |")


if __name__ == "__main__":
    main()
