"""The breaker (router/breaker.py): faults (connection resets, 5xx, stalls) eject a worker,
backpressure (4xx, 429, a draining 503) never does; an ejected worker comes back through
half-open; the state shows in GET /workers and radixserve_router:worker_state."""

from __future__ import annotations

import aiohttp
import orjson
import pytest
from aiohttp import web

from radixserve.testing.fake_replica import FakeReplicaConfig, fake_cluster, start_app
from router.app import ROUTER_KEY
from router.breaker import Breaker, WorkerState, is_fault, state_of
from router.config import PolicyName, RouterConfig
from router.workers import Worker
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

CFG = RouterConfig(policy=PolicyName.ROUND_ROBIN, health_interval_s=0.05,
                   health_timeout_s=1.0, retry_backoff_s=0.01, breaker_cooldown_s=0.3)


def test_what_counts_as_a_fault() -> None:
    draining = orjson.dumps({"error": {"code": "draining", "type": "x"}})
    assert is_fault(500, b"") and is_fault(502, b"") and is_fault(503, b"{}")
    assert not is_fault(503, draining)
    assert not any(is_fault(s, b"") for s in (400, 401, 404, 413, 429))


def test_cool_down_doubles_and_half_open_closes_on_success() -> None:
    now = [0.0]
    breaker = Breaker(cooldown_s=1.0, max_cooldown_s=3.0, clock=lambda: now[0])
    w = Worker("http://w")
    breaker.trip(w)
    breaker.probe_ok(w)
    assert state_of(w) is WorkerState.OPEN  # still cooling down
    now[0] = 1.0
    breaker.probe_ok(w)
    assert state_of(w) is WorkerState.HALF_OPEN
    breaker.trip(w)  # the trial failed: open again, twice as long
    now[0] = 2.5
    breaker.probe_ok(w)
    assert state_of(w) is WorkerState.OPEN
    now[0] = 3.0
    breaker.probe_ok(w)
    breaker.success(w)
    assert state_of(w) is WorkerState.CLOSED and w.trips == 0
    for _ in range(5):
        breaker.trip(w)
    assert w.open_until == 3.0 + 3.0  # capped


class Flaky:
    """/v1/completions: a fixed status, or a reset connection while `reset` is set."""

    def __init__(self, status: int = 200, code: str | None = None) -> None:
        self.status, self.code, self.reset = status, code, False
        self.num_requests = 0
        self.app = web.Application()
        self.app.router.add_post("/v1/completions", self._answer)
        self.app.router.add_get("/health", self._health)

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        self.num_requests += 1
        await request.read()
        if self.reset:
            assert request.transport is not None
            request.transport.abort()
            return web.Response()
        if self.status == 200:
            return web.json_response({"choices": [{"text": "ok"}]},
                                     headers={"X-Fake-Replica": "flaky"})
        return web.json_response({"error": {"message": "no", "type": "x", "param": None,
                                            "code": self.code}}, status=self.status)


async def states(s: aiohttp.ClientSession, url: str) -> dict[str, str]:
    async with s.get(f"{url}/workers") as resp:
        return {w["url"]: w["state"] for w in (await resp.json())["workers"]}


@pytest.mark.parametrize("status, code", [(429, None), (429, "rate_limit_exceeded"),
                                          (400, None), (503, "draining")])
async def test_backpressure_never_ejects(status: int, code: str | None) -> None:
    flaky = Flaky(status, code)
    runner, flaky_url = await start_app(flaky.app)
    try:
        async with fake_cluster(CFG, [FakeReplicaConfig(name="good")]) as c, \
                aiohttp.ClientSession() as s:
            c.router_app[ROUTER_KEY].add_worker(flaky_url)
            for i in range(12):
                async with s.post(f"{c.url}/v1/completions", json={"prompt": f"p{i}"}) as r:
                    await r.read()
            assert flaky.num_requests >= 6  # round robin kept sending it its share
            assert (await states(s, c.url))[flaky_url] == "closed"
            async with s.get(f"{c.url}/metrics") as resp:
                text = await resp.text()
            assert f'radixserve_router:worker_state{{worker="{flaky_url}"}} 0.0' in text
    finally:
        await runner.cleanup()


async def test_resetting_worker_is_ejected_then_probed_back_in() -> None:
    flaky = Flaky()
    flaky.reset = True
    runner, flaky_url = await start_app(flaky.app)
    try:
        async with fake_cluster(CFG, [FakeReplicaConfig(name="good")]) as c, \
                aiohttp.ClientSession() as s:
            router = c.router_app[ROUTER_KEY]
            worker = router.add_worker(flaky_url)

            async def send(n: int) -> list[str]:
                names = []
                for i in range(n):
                    async with s.post(f"{c.url}/v1/completions", json={"prompt": f"q{i}"}) as r:
                        assert r.status == 200  # retried on the good one
                        names.append(r.headers["X-Fake-Replica"])
                return names

            await send(4)
            assert (await states(s, c.url))[flaky_url] == "open"
            async with s.get(f"{c.url}/metrics") as resp:
                assert f'worker_state{{worker="{flaky_url}"}} 2.0' in await resp.text()
            tried = flaky.num_requests
            assert set(await send(6)) == {"good"} and flaky.num_requests == tried  # ejected
            flaky.reset = False  # healthy again
            await wait_until(lambda: state_of(worker) is WorkerState.HALF_OPEN,
                             what="half-open after the cool-down")
            assert "flaky" in await send(4)  # the trial request went there and succeeded
            assert (await states(s, c.url))[flaky_url] == "closed"
    finally:
        await runner.cleanup()
