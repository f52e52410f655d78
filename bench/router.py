"""Router benchmark on fake replicas that simulate a prefix cache (no model, no GPU).

    python -m bench.router [--replicas 4 --groups 16 --per-group 24 --concurrency 32]
    python -m bench.router --trace pressure [--tenants 96 --requests 512 --cache-blocks 1024]

Three processes, as deployed: the fake replicas (radixserve/testing/fake_replica.py: serialized prefill
that costs `--prefill-us` per UNCACHED prompt token, an LRU prefix cache of `--cache-blocks`
blocks per replica, real /kv_events), the router, and this client. Scenarios, each from cold
caches: round_robin, cache_aware (approximate index), cache_aware + kv events (precise). The
workload is SGLang's generated-shared-prefix shape: G groups x P prompts, each a shared
prefix plus a unique suffix, shuffled, `--concurrency` in flight. Reported: throughput, TTFT
p50/p90/p99, prefix hit rate (cached / prompt tokens from `usage`). `--trace pressure` swaps
the workload for bench/common/router_trace.py's multi-tenant trace (Zipf-popular tenants whose long
prefixes overflow the replicas' LRU caches) and skips the latency part. Then the router's added
latency: sequential tiny requests to an instant replica, direct vs through the router (and
through SGLang's router when `--sglang-router PYTHON` points at a venv that has it).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import orjson

from bench.common.router_trace import TraceConfig, prefix_tokens, pressure_trace
from radixserve.testing.fake_replica import ByteEncoder, FakeReplica, FakeReplicaConfig, start_app
from router.config import PolicyName, RouterConfig


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--role", choices=["bench", "replicas", "router"], default="bench")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--per-group", type=int, default=24)
    p.add_argument("--prefix-len", type=int, default=1024, help="shared prefix tokens")
    p.add_argument("--suffix-len", type=int, default=64, help="unique suffix tokens")
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--hot-fraction", type=float, default=0.0,
                   help="skew: this fraction of requests share one prefix")
    p.add_argument("--prefill-us", type=float, default=150.0, help="per uncached token")
    p.add_argument("--decode-ms", type=float, default=8.0, help="per output token")
    p.add_argument("--cache-blocks", type=int, default=512, help="per replica, 16 tokens each")
    p.add_argument("--trace", choices=["groups", "pressure"], default="groups")
    p.add_argument("--tenants", type=int, default=TraceConfig.tenants, help="pressure trace")
    p.add_argument("--requests", type=int, default=TraceConfig.requests, help="pressure trace")
    p.add_argument("--zipf", type=float, default=TraceConfig.zipf_s, help="pressure trace")
    p.add_argument("--latency-requests", type=int, default=500)
    p.add_argument("--sglang-router", default=None, metavar="PYTHON",
                   help="a python with sglang-router installed, to measure its added latency")
    p.add_argument("--out", default="bench/results/router.json")
    # for --role router
    p.add_argument("--policy", default="cache_aware")
    p.add_argument("--kv-events", action="store_true")
    p.add_argument("--router-replicas", type=int, default=1)
    p.add_argument("--workers", default="")
    p.add_argument("--balance-lambda", type=float, default=RouterConfig().balance_lambda)
    return p.parse_args(argv)


# --- child processes -------------------------------------------------------------------------

async def _serve_forever(urls: list[str]) -> None:
    print(json.dumps(urls), flush=True)  # the parent waits for this line
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()


async def serve_replicas(args: argparse.Namespace) -> None:
    base = FakeReplicaConfig(cache_blocks=args.cache_blocks, decode_s_per_token=args.decode_ms
                             * 1e-3, prefill_s_per_token=args.prefill_us * 1e-6)
    fakes = [FakeReplica(dataclasses.replace(base, name=f"r{i}")) for i in range(args.replicas)]
    fakes.append(FakeReplica(FakeReplicaConfig(name="instant")))  # for the latency test
    await _serve_forever([await f.start() for f in fakes])


async def serve_router(args: argparse.Namespace) -> None:
    from router.app import create_app

    cfg = RouterConfig(workers=tuple(args.workers.split(",")), policy=PolicyName(args.policy),
                       kv_events=args.kv_events, health_interval_s=1.0,
                       router_replicas=args.router_replicas,
                       balance_lambda=args.balance_lambda)
    _, url = await start_app(create_app(cfg, encoder=ByteEncoder()))
    await _serve_forever([url])


@contextlib.asynccontextmanager
async def child(cmd: list[str]) -> AsyncIterator[list[str]]:
    """Start a child that prints its URLs as one JSON line; terminate it on exit."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = await asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline)
        if not line:
            raise RuntimeError(f"{cmd} exited with {proc.wait()}")
        yield list(json.loads(line))
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen[Any]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def wait_healthy(s: aiohttp.ClientSession, url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(aiohttp.ClientError):
            async with s.get(f"{url}/health") as resp:
                if resp.status == 200:
                    return
        await asyncio.sleep(0.1)
    raise TimeoutError(f"{url} never became healthy")


# --- load ------------------------------------------------------------------------------------

@dataclass
class Result:
    name: str
    throughput: float  # requests / s
    ttft_p50_ms: float
    ttft_p99_ms: float
    hit_rate: float
    ttft_p90_ms: float = 0.0


@dataclass
class Report:
    results: list[Result]
    direct_ms: dict[str, float]  # p50, p99 of direct calls
    added_ms: dict[str, dict[str, float]]  # router -> p50, p99 added over direct


def make_prompts(args: argparse.Namespace) -> list[str]:
    rng = random.Random(0)
    if args.trace == "pressure":
        trace = TraceConfig(tenants=args.tenants, requests=args.requests,
                            prefix_len=args.prefix_len, suffix_len=args.suffix_len,
                            zipf_s=args.zipf)
        print(f"pressure trace: {prefix_tokens(trace)} prefix tokens over "
              f"{args.replicas} x {args.cache_blocks * 16} cached tokens", flush=True)
        return pressure_trace(trace, rng)
    letters = "abcdefghijklmnopqrstuvwxyz "

    def text(n: int) -> str:
        return "".join(rng.choice(letters) for _ in range(n))

    prefixes = [text(args.prefix_len) for _ in range(args.groups)]
    total = args.groups * args.per_group
    # --hot-fraction of the requests share group 0's prefix; the rest spread evenly.
    num_hot = round(total * args.hot_fraction) if args.hot_fraction else 0
    groups = [0] * num_hot + [i % args.groups for i in range(total - num_hot)]
    prompts = [prefixes[g] + text(args.suffix_len) for g in groups]
    rng.shuffle(prompts)
    return prompts


async def one_stream(s: aiohttp.ClientSession, url: str, prompt: str,
                     max_tokens: int, model: str | None = "fake") -> tuple[float, int, int]:
    """(TTFT s, cached tokens, prompt tokens) of one streamed completion."""
    start = time.perf_counter()
    ttft = None
    usage: dict[str, Any] = {}
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "stream": True,
                            "stream_options": {"include_usage": True}}
    if model is not None:
        body["model"] = model
    async with s.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        async for line in resp.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = orjson.loads(line[6:])
            if chunk["choices"] and ttft is None:
                ttft = time.perf_counter() - start
            if chunk.get("usage"):
                usage = chunk["usage"]
    assert ttft is not None and usage
    return ttft, usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]


async def run_load(name: str, url: str, prompts: list[str], args: argparse.Namespace) -> Result:
    sem = asyncio.Semaphore(args.concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def one(p: str) -> tuple[float, int, int]:
            async with sem:
                return await one_stream(s, url, p, args.output_len)

        start = time.perf_counter()
        rows = await asyncio.gather(*(one(p) for p in prompts))
        wall = time.perf_counter() - start
    ttft = np.array([r[0] for r in rows]) * 1e3
    return Result(name, len(prompts) / wall, float(np.percentile(ttft, 50)),
                  float(np.percentile(ttft, 99)), sum(r[1] for r in rows) / sum(r[2] for r in rows),
                  float(np.percentile(ttft, 90)))


async def flush(s: aiohttp.ClientSession, urls: list[str]) -> None:
    for u in urls:
        async with s.post(f"{u}/flush_cache") as resp:
            assert resp.status == 200


async def latencies(s: aiohttp.ClientSession, urls: Sequence[str], n: int) -> list[np.ndarray]:
    """Per-URL latencies (ms) of sequential 1-token requests, the URLs interleaved so that
    the machine's noise falls on all of them alike."""
    out: list[list[float]] = [[] for _ in urls]
    for i in range(n + 20):
        for j, url in enumerate(urls):
            body = {"model": "fake", "prompt": f"hi {i % 7}", "max_tokens": 1}
            start = time.perf_counter()
            async with s.post(f"{url}/v1/completions", json=body) as resp:
                await resp.read()
                assert resp.status == 200
            if i >= 20:  # warm-up: connections, caches
                out[j].append((time.perf_counter() - start) * 1e3)
    return [np.array(x) for x in out]


# --- driver ----------------------------------------------------------------------------------

def router_cmd(policy: str, kv_events: bool, workers: Sequence[str],
               balance_lambda: float) -> list[str]:
    cmd = [sys.executable, "-m", "bench.router", "--role", "router", "--policy", policy,
           "--workers", ",".join(workers), "--balance-lambda", str(balance_lambda)]
    return cmd + (["--kv-events"] if kv_events else [])


def _hashed(args: argparse.Namespace, kv: bool, workers: Sequence[str]) -> Any:
    """cache_aware as one of several routers: misses go to the prefix's rendezvous home."""
    cmd = router_cmd("cache_aware", kv, workers, args.balance_lambda)
    return _first(child([*cmd, "--router-replicas", "2"]))


@contextlib.asynccontextmanager
async def sglang_router(python: str, workers: Sequence[str]) -> AsyncIterator[str]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([python, "-m", "sglang_router.launch_router", "--worker-urls",
                             *workers, "--host", "127.0.0.1", "--port", str(port),
                             "--policy", "cache_aware", "--log-level", "error"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(proc)


def _ours(args: argparse.Namespace, policy: str, kv: bool, workers: Sequence[str]) -> Any:
    return _first(child(router_cmd(policy, kv, workers, args.balance_lambda)))


@contextlib.asynccontextmanager
async def _first(cm: Any) -> AsyncIterator[str]:
    async with cm as urls:
        yield urls[0]


def load_scenarios(args: argparse.Namespace, workers: Sequence[str]) -> list[tuple[str, Any]]:
    """(name, async context manager yielding the router URL) for each load scenario."""
    out = [("round_robin", _ours(args, "round_robin", False, workers)),
           ("cache_aware", _ours(args, "cache_aware", False, workers)),
           ("cache_aware + kv events", _ours(args, "cache_aware", True, workers))]
    if args.trace == "pressure":
        out += [("cache_aware, hash ties", _hashed(args, False, workers)),
                ("cache_aware + kv events, hash ties", _hashed(args, True, workers))]
    if args.sglang_router:
        out.append(("sglang-router cache_aware", sglang_router(args.sglang_router, workers)))
    return out


def latency_routers(args: argparse.Namespace, instant: str) -> list[tuple[str, Any]]:
    out = [("radixserve-router", _ours(args, "cache_aware", False, [instant]))]
    if args.sglang_router:
        out.append(("sglang-router", sglang_router(args.sglang_router, [instant])))
    return out




async def bench(args: argparse.Namespace) -> Report:
    prompts = make_prompts(args)
    rep_cmd = [sys.executable, "-m", "bench.router", "--role", "replicas",
               "--replicas", str(args.replicas), "--cache-blocks", str(args.cache_blocks),
               "--prefill-us", str(args.prefill_us), "--decode-ms", str(args.decode_ms)]
    results: list[Result] = []
    async with child(rep_cmd) as urls, aiohttp.ClientSession() as s:
        workers, instant = urls[:-1], urls[-1]
        for name, router in load_scenarios(args, workers):
            await flush(s, workers)
            async with router as router_url:
                await wait_healthy(s, router_url)
                await asyncio.sleep(0.3)  # kv streams connect
                results.append(await run_load(name, router_url, prompts, args))
                print(results[-1], flush=True)
        if args.trace == "pressure":
            return Report(results, {}, {})
        async with contextlib.AsyncExitStack() as stack:
            names, router_urls = [], []
            for name, router in latency_routers(args, instant):
                names.append(name)
                router_urls.append(await stack.enter_async_context(router))
                await wait_healthy(s, router_urls[-1])
            direct, *via = await latencies(s, [instant, *router_urls], args.latency_requests)
    pct = {q: float(np.percentile(direct, p)) for q, p in (("p50", 50), ("p99", 99))}
    added = {name: {q: float(np.percentile(v, p)) - pct[q] for q, p in (("p50", 50), ("p99", 99))}
             for name, v in zip(names, via, strict=True)}
    return Report(results, pct, added)


def print_report(report: Report) -> None:
    print("| policy | throughput (req/s) | TTFT p50 (ms) | TTFT p90 (ms) | TTFT p99 (ms) | "
          "hit rate |")
    print("|---|---|---|---|---|---|")
    for r in report.results:
        print(f"| {r.name} | {r.throughput:.1f} | {r.ttft_p50_ms:.1f} | {r.ttft_p90_ms:.1f} | "
              f"{r.ttft_p99_ms:.1f} | {r.hit_rate:.3f} |")
    if not report.direct_ms:
        return
    d = report.direct_ms
    print(f"\ndirect 1-token request: p50 {d['p50']:.2f} ms, p99 {d['p99']:.2f} ms")
    for name, a in report.added_ms.items():
        print(f"added by {name}: p50 {a['p50']:+.2f} ms, p99 {a['p99']:+.2f} ms")


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.role == "replicas":
        asyncio.run(serve_replicas(args))
        return
    if args.role == "router":
        asyncio.run(serve_router(args))
        return
    report = asyncio.run(bench(args))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({**dataclasses.asdict(report), "args": vars(args)},
                                         indent=2))
    print_report(report)


if __name__ == "__main__":
    main()
