"""Router hardening: admin routes off without an admin key, precise mode against replicas that
use API keys, bounded per-replica block sets, retries before the first byte only (5xx, 429,
connection errors), and a draining replica taken out of rotation."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from radixserve.api.api_keys import cache_salt_for_api_key
from radixserve.config import EngineConfig, ServerConfig
from radixserve.ipc.client import EngineClient
from radixserve.kv_events.publisher import BlockStored, EventBatch, block_hashes
from radixserve.server.app import create_app as create_server_app
from radixserve.server.app_state import STATE_KEY
from radixserve.testing.fake_engine import FakeEngine, InlineTransport
from radixserve.testing.fake_replica import FakeReplicaConfig, fake_cluster, start_app
from router.app import ROUTER_KEY
from router.app import create_app as create_router_app
from router.config import PolicyName, RouterConfig
from router.routing.kv_index import PreciseIndex
from router.workers import WorkerPool, health_loop
from tests.tiny_models import make_tokenizer

pytestmark = pytest.mark.timeout(60)

FAST = RouterConfig(health_interval_s=0.05, health_timeout_s=1.0, retry_backoff_s=0.01,
                    fail_threshold=2, success_threshold=1)
KEY = "replica-key-123"


async def wait_until(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not cond():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_admin_routes_are_off_without_an_admin_key() -> None:
    async with fake_cluster(FAST, [FakeReplicaConfig()]) as c, aiohttp.ClientSession() as s:
        async with s.post(f"{c.url}/workers", json={"url": "http://127.0.0.1:1"}) as resp:
            assert resp.status == 403
            assert (await resp.json())["error"]["code"] == "admin_disabled"
        async with s.delete(f"{c.url}/workers", params={"url": c.replicas[0].url}) as resp:
            assert resp.status == 403
        async with s.post(f"{c.url}/flush_cache") as resp:
            assert resp.status == 403
        async with s.get(f"{c.url}/workers") as resp:  # read-only listing stays open
            assert resp.status == 200
        assert len(c.router_app[ROUTER_KEY].pool.all()) == 1


def test_precise_block_sets_are_bounded() -> None:
    index = PreciseIndex(block_size=16, pending_ttl_s=30.0, max_blocks=4)
    index.add_worker("w")
    index.set_live("w", True)
    index.apply("w", EventBatch(1, (BlockStored((1, 2, 3), None, (), 16),)))
    assert index.match([1, 2, 3], "w") == 3  # 1, 2, 3 used: most recent now
    index.apply("w", EventBatch(2, (BlockStored((10, 11, 12), None, (), 16),)))
    st = index.state("w")
    assert st is not None and len(st.hashes) == 4 and st.num_dropped == 2
    assert set(st.hashes) == {3, 10, 11, 12}  # the least recently stored or used went first


@contextlib.asynccontextmanager
async def keyed_replica(tmp: Path) -> AsyncIterator[tuple[str, web.Application]]:
    """The real server app (fake engine, KV events on) guarded by an API key, on a free port."""
    make_tokenizer().save_pretrained(tmp)
    cfg = ServerConfig(api_keys=(KEY,), engine=EngineConfig(model=str(tmp),
                                                            enable_kv_events=True))
    factory = functools.partial(FakeEngine, eos_token_ids=())
    app = create_server_app(cfg, EngineClient(InlineTransport(factory, cfg.engine)))
    runner, url = await start_app(app)
    try:
        await wait_until(lambda: app[STATE_KEY].ready)
        yield url, app
    finally:
        await runner.cleanup()


async def test_precise_mode_follows_replicas_that_use_api_keys(tmp_path: Path) -> None:
    ids = list(range(40, 80))  # 40 token ids: 2 full blocks of 16
    async with keyed_replica(tmp_path) as (url, _), aiohttp.ClientSession() as s:
        cfg = dataclasses.replace(FAST, kv_events=True, replica_api_key=KEY, workers=(url,))
        router_app = create_router_app(cfg)
        runner, router_url = await start_app(router_app)
        try:
            precise = router_app[ROUTER_KEY].precise
            assert precise is not None
            await wait_until(lambda: precise.is_live(url))
            async with s.post(f"{router_url}/v1/completions",
                              json={"prompt": ids, "max_tokens": 2, "temperature": 0},
                              headers={"Authorization": f"Bearer {KEY}"}) as resp:
                assert resp.status == 200, await resp.text()
            want = set(block_hashes(ids[:32], 16, cache_salt_for_api_key(KEY)))
            st = precise.state(url)
            assert st is not None
            await wait_until(lambda: want <= set(st.hashes))
        finally:
            await runner.cleanup()
        # Without the replicas' key the stream is refused: never live, approximate index used.
        cfg = dataclasses.replace(cfg, replica_api_key=None)
        router_app = create_router_app(cfg)
        runner, _ = await start_app(router_app)
        try:
            await asyncio.sleep(0.3)
            precise = router_app[ROUTER_KEY].precise
            assert precise is not None and not precise.is_live(url)
        finally:
            await runner.cleanup()


class StatusWorker:
    """A worker that answers every generation request with one fixed status."""

    def __init__(self, status: int, code: str | None = None) -> None:
        self.status = status
        self.code = code
        self.num_requests = 0
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self._answer)
        self.app.router.add_get("/health", self._ok)

    async def _ok(self, request: web.Request) -> web.Response:
        return web.Response(text="{}")

    async def _answer(self, request: web.Request) -> web.Response:
        self.num_requests += 1
        await request.read()
        return web.json_response({"error": {"message": "no", "type": "x", "param": None,
                                            "code": self.code}}, status=self.status,
                                 headers={"Retry-After": "1"})


@pytest.mark.parametrize("status, code, retried, suspect", [
    (500, None, True, True), (502, None, True, True), (429, None, True, False),
    (429, "queue_full", True, False), (400, None, False, False), (404, None, False, False),
    # The caller's own per-key limit: relayed, or every replica would grant the key its rpm.
    (429, "rate_limit_exceeded", False, False), (429, "concurrency_limit_exceeded", False,
                                                 False)])
async def test_retries_before_first_byte_only_on_5xx_and_429(status: int, code: str | None,
                                                             retried: bool,
                                                             suspect: bool) -> None:
    bad = StatusWorker(status, code)
    bad_runner, bad_url = await start_app(bad.app)
    cfg = dataclasses.replace(FAST, policy=PolicyName.ROUND_ROBIN, health_interval_s=60.0)
    try:
        async with fake_cluster(cfg, [FakeReplicaConfig(name="good")]) as c, \
                aiohttp.ClientSession() as s:
            router = c.router_app[ROUTER_KEY]
            router.add_worker(bad_url)
            statuses = []
            for i in range(4):
                async with s.post(f"{c.url}/v1/completions", json={"prompt": f"p{i}"}) as r:
                    statuses.append(r.status)
            assert bad.num_requests >= 1  # round robin sent it some first tries
            worker = router.pool.get(bad_url)
            assert worker is not None and worker.suspect is suspect
            if retried:
                assert statuses == [200] * 4
            else:
                assert statuses.count(status) == bad.num_requests >= 1
            # Alone, a retryable answer comes back as it stands once no worker is left.
            await router.remove_worker(c.replicas[0].url)
            worker.suspect = False
            async with s.post(f"{c.url}/v1/completions", json={"prompt": "q"}) as r:
                assert r.status == status and (await r.json())["error"]["code"] == code
                assert r.headers["Retry-After"] == "1"
    finally:
        await bad_runner.cleanup()


async def test_draining_replica_is_taken_out_of_rotation(tmp_path: Path) -> None:
    async with keyed_replica(tmp_path) as (url, app), aiohttp.ClientSession() as s:
        cfg = dataclasses.replace(FAST, workers=(url,))
        router_app = create_router_app(cfg)
        runner, router_url = await start_app(router_app)
        try:
            worker = router_app[ROUTER_KEY].pool.get(url)
            assert worker is not None
            await wait_until(lambda: worker.healthy and worker.consecutive_successes >= 1)
            app[STATE_KEY].draining = True  # what SIGTERM does
            await wait_until(lambda: not worker.healthy)
            async with s.get(f"{router_url}/health") as resp:
                assert resp.status == 503
        finally:
            await runner.cleanup()


async def test_health_loop_stops_when_cancelled_as_a_probe_is_requested() -> None:
    # The race behind a CI hang: a cancel landing in the same loop turn as probe_soon.set().
    # asyncio.wait_for (Python 3.11) returned the event's result and dropped the cancel, so the
    # loop slept a whole interval (60 s) before the router could shut down.
    pool = WorkerPool((), fail_threshold=2, success_threshold=1)
    async with aiohttp.ClientSession() as session:
        for _ in range(20):
            task = asyncio.create_task(health_loop(session, pool, 60.0, 1.0))
            await asyncio.sleep(0.07)  # past the 50 ms floor: waiting on probe_soon
            pool.probe_soon.set()
            task.cancel()
            done, _ = await asyncio.wait({task}, timeout=5.0)
            assert done == {task} and task.cancelled()
