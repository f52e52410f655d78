"""What the HTTP layer costs: `python -m bench.http_overhead [--model tiny|smollm2-135m|PATH]`.

1. A 1-token completion on a fully cached prompt, through HTTP (`radixserve serve` in its own
   process, POST /v1/completions with token ids) vs in-process `radixserve.LLM.generate`,
   plus, to split the difference, EngineClient -> engine process without HTTP. The three are
   interleaved request by request, so machine noise hits them alike; we report p50 of each,
   the HTTP/offline ratio, the overhead per request, and the HTTP layer's share of it.
2. /health latency p50/p99/max while N streams (default 64) decode, vs idle: the event loop
   must stay responsive because the engine runs in another process.

Owns: this measurement only. Does not know: engine internals.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import multiprocessing as mp
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from radixserve.config import EngineConfig
from radixserve.ipc.client import EngineClient

if TYPE_CHECKING:
    from radixserve import LLM


KV_TOKENS = 16384  # per engine; three engines run side by side


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q / 100 * (len(ordered) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def resolve_model_arg(spec: str, workdir: Path) -> str:
    if spec != "tiny":
        return spec
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.tiny_models import make_tiny_model

    return str(make_tiny_model(workdir / "tiny_llama"))


def start_server(model: str, dtype: str, threads: int,
                 log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "radixserve", "serve", "--model", model, "--port", str(port),
           "--dtype", dtype, "--num-threads", str(threads), "--kv-cache-tokens", str(KV_TOKENS),
           "--log-stats-interval", "3600"]
    with open(log, "wb") as sink:
        proc = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}"


async def wait_healthy(session: aiohttp.ClientSession, url: str, proc: subprocess.Popen[bytes],
                       timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            async with session.get(url + "/health") as resp:
                if resp.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.2)
    raise RuntimeError("server did not become healthy")


async def http_one_token(session: aiohttp.ClientSession, url: str, ids: list[int],
                         warm: bool = True) -> float:
    body = orjson.dumps({"prompt": ids, "max_tokens": 1, "temperature": 0})
    start = time.perf_counter()
    async with session.post(url + "/v1/completions", data=body,
                            headers={"Content-Type": "application/json"}) as resp:
        out = await resp.json()
    elapsed = time.perf_counter() - start
    assert resp.status == 200, out
    cached = out["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert not warm or cached >= len(ids) - 1, out["usage"]
    return elapsed


def offline_one_token(llm: LLM, ids: list[int], warm: bool = True) -> float:
    from radixserve.types import SamplingParams

    start = time.perf_counter()
    (res,) = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1))
    elapsed = time.perf_counter() - start
    assert not warm or res.num_cached_tokens >= len(ids) - 1
    return elapsed


async def client_one_token(client: EngineClient, ids: list[int]) -> float:
    from radixserve.ipc.messages import GenerateMsg
    from radixserve.types import SamplingParams

    msg = GenerateMsg(uuid.uuid4().hex, ids, SamplingParams(temperature=0, max_tokens=1))
    start = time.perf_counter()
    outputs = [out async for out in client.generate(msg)]
    elapsed = time.perf_counter() - start
    assert outputs[-1].finish_reason is not None
    return elapsed


async def overhead(session: aiohttp.ClientSession, url: str, llm: LLM, client: EngineClient,
                   ids: list[int], iters: int) -> dict[str, float]:
    """Three paths, interleaved: HTTP server, engine process without HTTP, in-process."""
    for _ in range(3):  # warm every path and fill every cache with the prompt
        await http_one_token(session, url, ids, warm=False)
        await client_one_token(client, ids)
        offline_one_token(llm, ids, warm=False)
    http_s: list[float] = []
    proc_s: list[float] = []
    offline_s: list[float] = []
    for _ in range(iters):
        http_s.append(await http_one_token(session, url, ids))
        proc_s.append(await client_one_token(client, ids))
        offline_s.append(offline_one_token(llm, ids))
    http_p50, proc_p50 = statistics.median(http_s), statistics.median(proc_s)
    off_p50 = statistics.median(offline_s)
    return {"http_p50_ms": 1e3 * http_p50, "engine_proc_p50_ms": 1e3 * proc_p50,
            "offline_p50_ms": 1e3 * off_p50, "ratio_p50": http_p50 / off_p50,
            "overhead_p50_ms": 1e3 * (http_p50 - off_p50),
            "http_layer_p50_ms": 1e3 * (http_p50 - proc_p50),
            "http_p99_ms": 1e3 * pct(http_s, 99), "offline_p99_ms": 1e3 * pct(offline_s, 99)}


async def one_stream(session: aiohttp.ClientSession, url: str, prompt: str, tokens: int) -> int:
    """One streamed completion; returns its completion tokens (from the usage chunk)."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    completion_tokens = 0
    async with session.post(url + "/v1/completions", json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: {"):
                usage = orjson.loads(line[6:]).get("usage")
                if usage:
                    completion_tokens = usage["completion_tokens"]
    return completion_tokens


def probe_health(url: str, interval: float, stop: Any, out: Any, limit: int) -> None:
    """Runs in its own process (blocking http.client, one keep-alive connection), so that
    the stream readers of this benchmark cannot delay it: what it measures is the server."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    samples: list[float] = []
    out.send("ready")
    while not stop.is_set() and len(samples) < limit:
        start = time.perf_counter()
        conn.request("GET", "/health")
        conn.getresponse().read()
        samples.append(time.perf_counter() - start)
        time.sleep(interval)
    conn.close()
    out.send(samples)


def start_probe(url: str, limit: int = 10**9) -> tuple[Any, Any, Any]:
    ctx = mp.get_context("spawn")
    stop, (recv, send) = ctx.Event(), ctx.Pipe(duplex=False)
    proc = ctx.Process(target=probe_health, args=(url, 0.01, stop, send, limit))
    proc.start()
    assert recv.recv() == "ready"
    return proc, stop, recv


def finish_probe(probe: tuple[Any, Any, Any]) -> list[float]:
    proc, stop, recv = probe
    stop.set()
    samples: list[float] = recv.recv()
    proc.join(30)
    return samples


async def health_under_load(url: str, streams: int, tokens: int) -> dict[str, float]:
    loop = asyncio.get_running_loop()
    idle = await loop.run_in_executor(None, lambda: finish_probe_after(start_probe(url, 100)))
    conn = aiohttp.TCPConnector(limit=streams + 8)
    async with aiohttp.ClientSession(connector=conn) as session:
        probe = await loop.run_in_executor(None, start_probe, url)
        start = time.perf_counter()
        counts = await asyncio.gather(*(one_stream(session, url, f"stream {i}: ", tokens)
                                        for i in range(streams)))
        elapsed = time.perf_counter() - start
        busy = finish_probe(probe)
    return {"streams": streams, "stream_tokens": sum(counts),
            "stream_tok_per_s": sum(counts) / elapsed, "health_samples": len(busy),
            "health_idle_p50_ms": 1e3 * statistics.median(idle),
            "health_idle_p99_ms": 1e3 * pct(idle, 99),
            "health_busy_p50_ms": 1e3 * statistics.median(busy),
            "health_busy_p99_ms": 1e3 * pct(busy, 99), "health_busy_max_ms": 1e3 * max(busy)}


def finish_probe_after(probe: tuple[Any, Any, Any]) -> list[float]:
    """For a probe with a sample limit: wait for it to finish by itself."""
    proc, _, recv = probe
    samples: list[float] = recv.recv()
    proc.join(30)
    return samples


async def run(args: argparse.Namespace, model: str, workdir: Path) -> dict[str, Any]:
    proc, url = start_server(model, args.dtype, args.num_threads, workdir / "server.log")
    try:
        async with aiohttp.ClientSession() as session:
            await wait_healthy(session, url, proc)
            from radixserve import LLM  # here: the probe process must not import torch

            llm = LLM(model=model, dtype=args.dtype, num_threads=args.num_threads,
                      kv_cache_tokens=KV_TOKENS)
            client = EngineClient.spawn(EngineConfig(
                model=model, dtype=args.dtype, num_threads=args.num_threads,
                kv_cache_tokens=KV_TOKENS))
            await client.start()
            vocab = len(llm.tokenizer)
            ids = [(7 * i + 3) % min(vocab, 250) + 1 for i in range(args.prompt_len)]
            try:
                result: dict[str, Any] = await overhead(session, url, llm, client, ids,
                                                        args.iters)
            finally:
                await client.shutdown()
            del llm
        result.update(await health_under_load(url, args.streams, args.stream_tokens))
        return result
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny | smollm2-135m | an HF folder")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-threads", type=int, default=max(1, (os.cpu_count() or 2) // 2))
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--stream-tokens", type=int, default=128)
    parser.add_argument("--json", type=Path, default=None, help="also write the result here")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = resolve_model_arg(args.model, Path(tmp))
        result = asyncio.run(run(args, model, Path(tmp)))
    result.update(model=args.model, dtype=args.dtype, prompt_len=args.prompt_len,
                  num_threads=args.num_threads)
    width = max(len(k) for k in result)
    for key, value in result.items():
        shown = f"{value:.3f}" if isinstance(value, float) else value
        print(f"{key:<{width}}  {shown}")
    if args.json is not None:
        args.json.write_bytes(orjson.dumps(result, option=orjson.OPT_INDENT_2))


if __name__ == "__main__":
    main()
