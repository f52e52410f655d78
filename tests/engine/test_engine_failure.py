"""The engine dying, against the in-process fake: every request in flight ends with an error
(JSON 500, or an SSE error event then [DONE]), /health turns 503, and the supervisor either
restarts the engine (backoff, counted in /metrics) or returns exit code 1."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp.test_utils import TestClient, TestServer

from radixserve.config import EngineConfig, ServerConfig
from radixserve.ipc.client import EngineClient, EngineState
from radixserve.server import serve as serve_mod
from radixserve.server.app import create_app
from radixserve.server.app_state import STATE_KEY
from radixserve.testing.fake_engine import FakeEngine, InlineTransport
from tests.server.test_app import GREEDY, call
from tests.waiting import wait_until

SLOW = {"prompt": "abcdefgh", "max_tokens": 300, **GREEDY}


@contextlib.asynccontextmanager
async def crashing(model_dir: Path, restart: bool,
                   fail_at_step: int = 20) -> AsyncIterator[tuple[TestClient, Any]]:
    """A server whose first engine crashes at `fail_at_step`; replacements never crash."""
    cfg = ServerConfig(engine=EngineConfig(model=str(model_dir)), restart_engine=restart)
    first = functools.partial(FakeEngine, fail_at_step=fail_at_step)

    def respawn() -> InlineTransport:
        return InlineTransport(FakeEngine, cfg.engine, 0.005)

    client = EngineClient(InlineTransport(first, cfg.engine, 0.005), respawn)
    app = create_app(cfg, client)
    async with TestClient(TestServer(app)) as tc:
        supervisor = asyncio.create_task(serve_mod.supervise(app, cfg))
        try:
            await wait_until(lambda: app[STATE_KEY].ready, what="engine ready")
            yield tc, supervisor
        finally:
            supervisor.cancel()
            await asyncio.gather(supervisor, return_exceptions=True)


async def test_in_flight_requests_fail_then_exit_1(model_dir: Path) -> None:
    async with crashing(model_dir, restart=False) as (tc, supervisor):
        stream = await tc.post("/v1/completions", data=orjson.dumps({**SLOW, "stream": True}))
        whole = asyncio.create_task(call(tc, "/v1/completions", SLOW))
        text = await stream.text()  # ends: no hang
        events = [e[6:] for e in text.split("\n\n") if e.startswith("data: ")]
        assert events[-1] == "[DONE]"
        err = orjson.loads(events[-2])["error"]
        assert err["type"] == "server_error" and err["code"] == "engine_failed"
        status, out = await whole
        assert status == 500 and out["error"]["code"] == "engine_failed"
        assert await asyncio.wait_for(supervisor, 30) == 1  # the process would exit 1
        status, health = await call(tc, "/health", method="GET")
        assert status == 503 and health["status"] == "dead"
        status, out = await call(tc, "/v1/completions", SLOW)
        assert status == 503 and out["error"]["code"] == "engine_dead"


async def test_restart_engine_with_backoff(model_dir: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(serve_mod, "RESTART_BACKOFF_S", 0.05)
    async with crashing(model_dir, restart=True) as (tc, supervisor):
        assert tc.app is not None
        state = tc.app[STATE_KEY]
        status, out = await call(tc, "/v1/completions", SLOW)
        assert status == 500 and out["error"]["code"] == "engine_failed"

        async def healthy_again() -> bool:
            return (await tc.get("/health")).status == 200

        await wait_until(healthy_again, what="the restarted engine healthy")
        assert state.client.state is EngineState.READY and not supervisor.done()
        status, out = await call(tc, "/v1/completions", {**SLOW, "max_tokens": 5})
        assert status == 200 and out["choices"][0]["text"] == "abcde"
        metrics = await (await tc.get("/metrics")).text()
        assert "radixserve:engine_restarts_total 1.0" in metrics
