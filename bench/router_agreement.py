"""Two routers in front of the same replicas: how often do they make the same choice?

    python -m bench.router_agreement [--requests 400 --concurrency 1 16 --replicas 4
                                      --balance-abs-threshold 0 8]

In-process (no timing is measured, only decisions): fake replicas with real /kv_events and an
LRU cache, two routers (A and B) in one mode, a multi-tenant trace (bench/common/router_trace.py)
sent alternately through A and B. Before each request goes through its router, both routers
are asked what they would choose for it (a dry run: nothing recorded); agreement is the share
of requests where the two choices are equal. Modes: precise (both follow every
replica's /kv_events) and approximate (each router's own index of what IT routed), each with
--router-replicas 2 (ties broken by hash, the same in both routers).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import random
from collections.abc import Sequence
from typing import Any

import aiohttp

from bench.common.router_trace import TraceConfig, pressure_trace
from radixserve.testing.fake_replica import (
    ByteEncoder,
    FakeReplica,
    FakeReplicaConfig,
    start_app,
)
from router.app import ROUTER_KEY, create_app
from router.config import RouterConfig
from router.core import Router
from router.routing.route_key import RequestKind


async def dry_choice(router: Router, body: dict[str, Any]) -> str | None:
    key = await router.route_key(RequestKind.COMPLETIONS, body, None)
    decision = router.choose(key)
    return None if decision is None else decision.worker.url


async def measure(mode: str, prompts: Sequence[str], replicas: int, cache_blocks: int,
                  concurrency: int, router_replicas: int = 2,
                  base: RouterConfig | None = None) -> float:
    """The share of requests on which the two routers agree (module docstring); `base`:
    the routers' other settings (e.g. parsed from a manifest's args)."""
    fakes = [FakeReplica(FakeReplicaConfig(name=f"r{i}", cache_blocks=cache_blocks))
             for i in range(replicas)]
    urls = tuple([await f.start() for f in fakes])
    cfg = dataclasses.replace(base or RouterConfig(), workers=urls,
                              kv_events=mode == "precise", router_replicas=router_replicas,
                              health_interval_s=0.5, kv_stream_timeout_s=5.0, tokenizer=None)
    apps = [create_app(cfg, encoder=ByteEncoder()) for _ in range(2)]
    started = [await start_app(app) for app in apps]
    routers = [app[ROUTER_KEY] for app in apps]
    agree = total = 0
    try:
        if mode == "precise":
            while not all(r.precise is not None and r.precise.is_live(u)
                          for r in routers for u in urls):
                await asyncio.sleep(0.02)
        sem = asyncio.Semaphore(concurrency)
        async with aiohttp.ClientSession() as s:
            async def one(i: int, prompt: str) -> None:
                nonlocal agree, total
                body = {"prompt": prompt, "max_tokens": 2}
                via, other = started[i % 2][1], routers[1 - i % 2]
                async with sem:
                    # Both routers' choices at the same instant (short prompts are keyed
                    # without yielding to the loop), then the request goes through one.
                    mine = await dry_choice(routers[i % 2], body)
                    predicted = await dry_choice(other, body)
                    async with s.post(f"{via}/v1/completions", json=body) as resp:
                        await resp.read()
                total += 1
                agree += predicted is not None and predicted == mine

            await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    finally:
        for runner, _ in started:
            await runner.cleanup()
        for f in fakes:
            await f.stop()
    return agree / total


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--tenants", type=int, default=24)
    p.add_argument("--prefix-len", type=int, default=512)
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--cache-blocks", type=int, default=256)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--balance-abs-threshold", type=int, nargs="+", default=[0, 8],
                   help="the routers' load dead band (router/deploy/router.yaml: 8)")
    args = p.parse_args(argv)
    trace = TraceConfig(tenants=args.tenants, requests=args.requests,
                        prefix_len=args.prefix_len)
    prompts = pressure_trace(trace, random.Random(0))
    print("| mode | balance-abs-threshold | concurrency | agreement |\n|---|---|---|---|")
    for mode in ("precise", "approximate"):
        for band in args.balance_abs_threshold:
            for conc in args.concurrency:
                base = RouterConfig(balance_abs_threshold=band)
                share = asyncio.run(measure(mode, prompts, args.replicas, args.cache_blocks,
                                            conc, base=base))
                print(f"| {mode} | {band} | {conc} | {share:.2%} |")


if __name__ == "__main__":
    main()


