"""Deadlines (--request-timeout, per-request `timeout`), bounded and slow bodies, the connection
cap, idle/slowloris connections, and draining, against the fake engine."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from radixserve.config import EngineConfig, ServerConfig
from radixserve.ipc.client import EngineClient
from radixserve.server.access.connections import GuardedRunner
from radixserve.server.app import create_app
from radixserve.server.app_state import STATE_KEY
from radixserve.server.serve import drain
from radixserve.testing.fake_engine import FakeEngine, InlineTransport
from tests.server.access.test_limits import wait_idle
from tests.server.test_app import GREEDY, call, serve
from tests.waiting import wait_until

LONG_RUN = {"prompt": "abcdefgh", "max_tokens": 400, **GREEDY}


async def test_server_request_timeout_aborts_and_frees(model_dir: Path) -> None:
    async with serve(model_dir, step_interval=0.01, request_timeout=0.2) as tc:
        status, out = await call(tc, "/v1/completions", LONG_RUN)
        assert status == 408 and out["error"]["code"] == "request_timeout"
        idle = await wait_idle(tc)  # the engine request was aborted: nothing held
        assert idle["kv_held_tokens"] == 0 and idle["generation_tokens"] < 400
        text = await (await tc.get("/metrics")).text()
        assert "radixserve:request_timeouts_total 1.0" in text
        status, out = await call(tc, "/v1/completions", {**LONG_RUN, "max_tokens": 3})
        assert status == 200  # short requests are unaffected


async def test_per_request_timeout_streaming_and_native(model_dir: Path) -> None:
    async with serve(model_dir, step_interval=0.01) as tc:
        resp = await tc.post("/v1/completions",
                             data=orjson.dumps({**LONG_RUN, "stream": True, "timeout": 0.2}))
        assert resp.status == 200  # the status line went out with the first chunk
        events = [e[6:] for e in (await resp.text()).split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert orjson.loads(events[-2])["error"]["code"] == "request_timeout"
        status, out = await call(tc, "/generate", {"text": "abcdefgh", "timeout": 0.2,
                                                   "sampling_params": {"max_new_tokens": 400}})
        assert status == 408 and out["error"]["code"] == "request_timeout"
        chat = {"messages": [{"role": "user", "content": "hi"}], "timeout": 0.2,
                "max_tokens": 400, "ignore_eos": True}
        status, out = await call(tc, "/v1/chat/completions", chat)
        assert status == 408
        for bad in (0, -1, "5", 1e9):
            status, out = await call(tc, "/v1/completions", {**LONG_RUN, "timeout": bad})
            assert status == 400 and out["error"]["param"] == "timeout"
        idle = await wait_idle(tc)
        assert idle["kv_held_tokens"] == 0


async def test_body_too_large_is_413(model_dir: Path) -> None:
    async with serve(model_dir, max_body_bytes=1000) as tc:
        status, out = await call(tc, "/v1/completions", {"prompt": "x" * 2000})
        assert status == 413 and out["error"]["code"] == "body_too_large"
        assert (await call(tc, "/v1/completions", {"prompt": "x", **GREEDY}))[0] == 200


async def test_slow_body_is_408(model_dir: Path) -> None:
    async with serve(model_dir, body_timeout=0.3) as tc:
        assert tc.server.port is not None
        reader, writer = await asyncio.open_connection("127.0.0.1", tc.server.port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
        await writer.drain()  # ... and the remaining 90 bytes never come
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        assert head.startswith(b"HTTP/1.1 408")
        writer.close()
        assert (await call(tc, "/v1/completions", {"prompt": "x", **GREEDY}))[0] == 200


@contextlib.asynccontextmanager
async def guarded(model_dir: Path, **runner_kwargs: Any) -> AsyncIterator[tuple[int, Any]]:
    """create_app behind GuardedRunner (the runner `radixserve serve` uses) on a free port."""
    cfg = ServerConfig(engine=EngineConfig(model=str(model_dir)))
    factory = functools.partial(FakeEngine, eos_token_ids=())
    app = create_app(cfg, EngineClient(InlineTransport(factory, cfg.engine)))
    runner = GuardedRunner(app, **runner_kwargs)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield runner.addresses[0][1], runner
    finally:
        await runner.cleanup()


async def test_connection_cap_refuses_extra_connections(model_dir: Path) -> None:
    async with guarded(model_dir, max_connections=2) as (port, runner):
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answer = await asyncio.wait_for(reader.read(), 30)  # read to EOF: closed by server
        assert answer.startswith(b"HTTP/1.1 503") and b"too_many_connections" in answer
        assert runner.num_refused == 1
        writer.close()
        for _, w in held:
            w.close()
        # Once the idle ones are gone, a client gets in again.
        for _ in range(200):
            if len(runner.server.connections) < 2:
                break
            await asyncio.sleep(0.02)
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /version HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        assert (await asyncio.wait_for(r.read(), 30)).startswith(b"HTTP/1.1 200")
        w.close()


async def test_slowloris_headers_are_cut_off(model_dir: Path) -> None:
    async with guarded(model_dir, max_connections=10, keepalive_timeout=0.3) as (port, _):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Slow: a")  # never finished
        await writer.drain()
        assert await asyncio.wait_for(reader.read(), 30) == b""  # closed by the server
        writer.close()


async def test_drain_finishes_in_flight_and_refuses_new(model_dir: Path) -> None:
    async with serve(model_dir, step_interval=0.005) as tc:
        assert tc.app is not None
        state = tc.app[STATE_KEY]
        resp = await tc.post("/v1/completions", data=orjson.dumps(
            {**LONG_RUN, "max_tokens": 60, "stream": True}))
        await resp.content.readline()
        draining = asyncio.create_task(drain(state, timeout=60))
        for _ in range(100):
            if state.draining:
                break
            await asyncio.sleep(0.01)
        status, health = await call(tc, "/health", method="GET")
        assert status == 503 and health == {"status": "draining"}
        status, out = await call(tc, "/v1/completions", LONG_RUN)
        assert status == 503 and out["error"]["code"] == "draining"
        text = await resp.text()  # the admitted stream runs to its end
        assert '"finish_reason":"length"' in text and text.endswith("data: [DONE]\n\n")
        await asyncio.wait_for(draining, 30)
        assert state.admission.num_requests == 0


async def test_drain_gives_up_after_shutdown_timeout(model_dir: Path) -> None:
    async with serve(model_dir, step_interval=0.01) as tc:
        assert tc.app is not None
        state = tc.app[STATE_KEY]
        resp = await tc.post("/v1/completions", data=orjson.dumps({**LONG_RUN, "stream": True}))
        await resp.content.readline()
        await asyncio.wait_for(drain(state, timeout=0.1), 30)
        assert state.admission.num_requests == 1  # cut off: the engine's shutdown fails it
        resp.close()


async def post_slow_reader(port: int, path: str, body: dict[str, Any]) -> socket.socket:
    """POST `body` on a raw connection with a tiny receive buffer that the caller never reads
    (a client that stops taking bytes); the caller closes the socket."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fills up fast
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    raw = orjson.dumps(body)
    await loop.sock_sendall(sock, f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: "
                                  f"{len(raw)}\r\n\r\n".encode() + raw)
    return sock


async def test_stalled_stream_reader_is_dropped_and_aborted(model_dir: Path) -> None:
    body = {"prompt": "abcdefgh" * 8, "max_tokens": 400, "n": 64, "stream": True,
            "logprobs": 5, **GREEDY}  # ~40 MB of events: far more than socket buffers hold
    async with serve(model_dir, step_interval=0.005, send_timeout=0.3) as tc:
        assert tc.app is not None and tc.server.port is not None
        state = tc.app[STATE_KEY]
        sock = await post_slow_reader(tc.server.port, "/v1/completions", body)
        # ... and never reads: the server gives up on it and aborts the 64 choices.
        await wait_until(lambda: state.admission.num_requests == 1, what="admitted")
        await wait_until(lambda: state.admission.num_requests == 0, timeout=60,
                         what="the stalled stream dropped")
        idle = await wait_idle(tc)
        assert idle["kv_held_tokens"] == 0 and idle["generation_tokens"] < 64 * 400
        sock.close()
