"""Chaos: the engine process is killed (SIGKILL) under load. Every request in flight must end
with an error (JSON 500 or an SSE error event, then [DONE]) and none may hang; /health turns
503; then the server restarts the engine (--restart-engine) or exits 1.

The default run kills a real engine process running the fake engine (spawned like the real
one, so the pipes, threads and process death are real; it starts in about a second). The
`soak`-marked test does the same to `radixserve serve` on the tiny model and prints how long
the in-flight requests took to fail."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from radixserve.config import EngineConfig, ServerConfig
from radixserve.ipc.client import EngineClient, EngineState
from radixserve.server import serve as serve_mod
from radixserve.server.app import create_app
from radixserve.server.app_state import STATE_KEY
from radixserve.testing.fake_engine import FakeEngine
from tests.server.test_app import TOKENIZER
from tests.server_proc import ServerProc, running_server
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(180)
LONG = {"prompt": "abcdefgh", "max_tokens": 400, "temperature": 0}


async def one(session: aiohttp.ClientSession, url: str, stream: bool,
              key: str | None = None) -> tuple[str, float]:
    """Run one long request to its end: its outcome and when it ended (monotonic)."""
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    path = "/v1/completions" if stream else "/v1/chat/completions"
    body: dict[str, Any] = dict(LONG, stream=stream, ignore_eos=True)
    if not stream:
        body = {"messages": [{"role": "user", "content": "abc"}], "max_tokens": 400,
                "ignore_eos": True}
    async with session.post(url + path, data=orjson.dumps(body), headers=headers) as resp:
        text = await resp.text()
    ended = time.monotonic()
    if resp.status != 200:
        return f"json_{resp.status}_{orjson.loads(text)['error']['code']}", ended
    events = [e[6:] for e in text.split("\n\n") if e.startswith("data: ")]
    if len(events) >= 2 and events[-1] == "[DONE]" and '"error"' in events[-2]:
        return f"sse_error_{orjson.loads(events[-2])['error']['code']}", ended
    return "completed", ended


async def load_then_kill(url: str, engine_pid: int, running: Any, n: int = 8,
                         key: str | None = None) -> tuple[list[str], float]:
    """n long requests (half streaming); once all run, SIGKILL the engine. Returns their
    outcomes and the time the last one took to end after the kill."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        tasks = [asyncio.create_task(one(session, url, i % 2 == 0, key)) for i in range(n)]
        await wait_until(running, timeout=120, what=f"{n} requests running")
        killed = time.monotonic()
        os.kill(engine_pid, signal.SIGKILL)
        results = await asyncio.gather(*tasks)
    return [r for r, _ in results], max(t for _, t in results) - killed


@contextlib.asynccontextmanager
async def process_engine(tmp: Path, restart: bool) -> AsyncIterator[tuple[TestClient, Any]]:
    """The app over a real engine process (fake engine inside), supervised like `serve`."""
    TOKENIZER.save_pretrained(tmp)
    cfg = ServerConfig(engine=EngineConfig(model=str(tmp)), restart_engine=restart)
    client = EngineClient.spawn(cfg.engine, functools.partial(FakeEngine, step_delay=0.01))
    app = create_app(cfg, client)
    async with TestClient(TestServer(app)) as tc:
        supervisor = asyncio.create_task(serve_mod.supervise(app, cfg))
        try:
            await wait_until(lambda: app[STATE_KEY].ready, timeout=60, what="engine ready")
            yield tc, supervisor
        finally:
            supervisor.cancel()
            await asyncio.gather(supervisor, return_exceptions=True)


@pytest.mark.parametrize("restart", [False, True])
async def test_engine_killed_under_load(tmp_path: Path, restart: bool,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve_mod, "RESTART_BACKOFF_S", 0.5)
    async with process_engine(tmp_path, restart) as (tc, supervisor):
        assert tc.app is not None
        state = tc.app[STATE_KEY]
        url = str(tc.make_url("")).rstrip("/")
        pid = (await (await tc.get("/server_info")).json())["engine_pid"]
        outcomes, took = await load_then_kill(
            url, pid, lambda: state.client.stats.get("num_running") == 8)
        print(f"chaos (fake engine process): {len(outcomes)} in-flight requests all ended "
              f"{took:.3f}s after SIGKILL: {sorted(outcomes)}")
        assert sorted(set(outcomes)) == ["json_500_engine_failed", "sse_error_engine_failed"]
        health = await tc.get("/health")
        assert health.status == 503
        if not restart:
            assert await asyncio.wait_for(supervisor, 30) == 1  # `serve` exits 1
            assert (await health.json())["status"] == "dead"
            return

        async def healthy() -> bool:
            return (await tc.get("/health")).status == 200

        await wait_until(healthy, timeout=60, what="the restarted engine healthy")
        assert state.client.state is EngineState.READY and not supervisor.done()
        info = await (await tc.get("/server_info")).json()
        assert info["engine_pid"] != pid
        resp = await tc.post("/v1/completions", data=orjson.dumps({**LONG, "max_tokens": 4}))
        assert resp.status == 200 and (await resp.json())["choices"][0]["text"] == "abcd"
        assert "radixserve:engine_restarts_total 1.0" in await (await tc.get("/metrics")).text()


def running_requests(server: ServerProc, n: int) -> Any:
    def check() -> bool:
        return bool(server.info()["stats"].get("num_running", 0) >= n)
    return check


@pytest.mark.soak
@pytest.mark.parametrize("restart", [False, True])
def test_real_server_engine_killed(tiny_llama: Path, tmp_path: Path, restart: bool) -> None:
    args = ["--kv-cache-tokens", "16384", "--max-model-len", "1024"]
    args += ["--restart-engine"] if restart else []
    with running_server(tiny_llama, tmp_path / "server.log", args) as server:
        pid = server.info()["engine_pid"]
        outcomes, took = asyncio.run(load_then_kill(
            server.url, pid, running_requests(server, 8)))
        print(f"chaos (tiny model, --restart-engine={restart}): {len(outcomes)} in-flight "
              f"requests all ended {took:.3f}s after SIGKILL: {sorted(outcomes)}")
        assert sorted(set(outcomes)) == ["json_500_engine_failed", "sse_error_engine_failed"]
        status, health = server.get("/health")
        if not restart:
            assert server.proc.wait(60) == 1  # exits 1: systemd / Kubernetes restart it
            assert "the engine process died" in server.output()
            return
        assert status == 503
        t0 = time.monotonic()
        server.wait_healthy()
        print(f"chaos: engine restarted and healthy {time.monotonic() - t0:.1f}s later")
        assert server.info()["engine_pid"] != pid
        status, _ = server.get("/v1/models")
        assert status == 200
        assert server.stop() == 0
