"""EngineClient with the engine in a real spawned process (the fake engine inside): start-up,
streaming, abort, flush, shutdown by handle, and every way the engine can die."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from radixserve.config import EngineConfig, ServerConfig
from radixserve.ipc.client import (
    EngineClient,
    EngineFailedError,
    EngineState,
    EngineUnavailableError,
    ProcessTransport,
)
from radixserve.ipc.messages import GenerateMsg
from radixserve.server.app import create_app
from radixserve.testing.fake_engine import FakeEngine
from radixserve.testing.probes import num_in_flight
from radixserve.types import FinishReason, InvalidRequestError, SamplingParams, TokenOutput
from tests.server.test_app import TOKENIZER
from tests.waiting import wait_until

CFG = EngineConfig(model="fake")
GREEDY = SamplingParams(temperature=0, max_tokens=5)


@pytest.fixture
async def client() -> AsyncIterator[EngineClient]:
    c = EngineClient.spawn(CFG, functools.partial(FakeEngine, step_delay=0.005))
    await asyncio.wait_for(c.start(), 60)
    yield c
    await c.shutdown()


async def collect(c: EngineClient, rid: str, prompt: list[int],
                  params: SamplingParams = GREEDY) -> list[TokenOutput]:
    return [out async for out in c.generate(GenerateMsg(rid, prompt, params))]


def proc(c: EngineClient) -> ProcessTransport:
    transport = c.transport
    assert isinstance(transport, ProcessTransport)
    return transport


async def test_generate_abort_flush_shutdown(client: EngineClient) -> None:
    assert client.state is EngineState.READY and client.info["max_model_len"] == 512
    a, b = await asyncio.gather(collect(client, "a", [1, 2, 3]), collect(client, "b", [7, 8]))
    assert [o.token_id for o in a] == [1, 2, 3, 1, 2] and a[-1].finish_reason is FinishReason.LENGTH
    assert [o.token_id for o in b] == [7, 8, 7, 8, 7]
    with pytest.raises(InvalidRequestError, match="context"):
        await collect(client, "c", [1] * 600)
    stream = client.generate(GenerateMsg("d", [1, 2], SamplingParams(max_tokens=400)))
    await stream.__anext__()
    await stream.aclose()  # stops listening: the engine must abort it
    await wait_until(lambda: client.stats.get("num_aborted_requests") == 1,
                     what="the engine's abort of the closed stream")
    await wait_until(client.flush_cache, what="a flush (refused while anything runs)")
    assert client.stats["num_running"] == 0 and num_in_flight(client) == 0
    pid = proc(client).pid
    await client.shutdown()
    assert client.state is EngineState.STOPPED and not proc(client).is_alive()
    assert pid is not None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


async def test_engine_killed_fails_pending_requests(client: EngineClient) -> None:
    stream = client.generate(GenerateMsg("x", [1, 2], SamplingParams(max_tokens=400)))
    await stream.__anext__()
    pid = proc(client).pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(EngineFailedError):
        async for _ in stream:
            pass
    assert client.state is EngineState.DEAD
    with pytest.raises(EngineUnavailableError):
        await collect(client, "y", [1])


async def test_engine_crash_is_reported() -> None:
    c = EngineClient.spawn(CFG, functools.partial(FakeEngine, fail_at_step=3))
    await asyncio.wait_for(c.start(), 60)
    with pytest.raises(EngineFailedError, match="fake engine crash"):
        await collect(c, "a", [1, 2])
    assert c.state is EngineState.DEAD and "fake engine crash" in (c.error or "")
    await c.shutdown()
    assert not proc(c).is_alive()


async def test_start_failure_is_reported() -> None:
    c = EngineClient.spawn(CFG, functools.partial(FakeEngine, start_error="no such model"))
    with pytest.raises(EngineUnavailableError, match="no such model"):
        await asyncio.wait_for(c.start(), 60)
    await c.shutdown()
    assert not proc(c).is_alive()


async def test_health_is_503_while_loading(tmp_path: Path) -> None:
    TOKENIZER.save_pretrained(tmp_path)
    cfg = ServerConfig(engine=EngineConfig(model=str(tmp_path)))
    engine = EngineClient.spawn(cfg.engine, functools.partial(FakeEngine, start_delay=1.0))
    async with TestClient(TestServer(create_app(cfg, engine))) as tc:
        resp = await tc.get("/health")
        assert resp.status == 503 and (await resp.json())["status"] == "loading"
        resp = await tc.post("/v1/completions", json={"prompt": "a"})
        assert resp.status == 503 and (await resp.json())["error"]["code"] == "model_loading"

        async def healthy() -> bool:
            return (await tc.get("/health")).status == 200

        await wait_until(healthy, timeout=60, what="the engine loaded")
        resp = await tc.post("/v1/completions", json={"prompt": "ab", "max_tokens": 2,
                                                      "temperature": 0})
        assert resp.status == 200 and (await resp.json())["choices"][0]["text"] == "ab"
    assert engine.state is EngineState.STOPPED and not proc(engine).is_alive()
