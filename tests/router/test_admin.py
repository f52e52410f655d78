"""Router operations: admin auth, workers added/removed at run time, health, metrics, flush."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from radixserve.testing.fake_replica import FakeReplica, FakeReplicaConfig, fake_cluster
from radixserve.testing.probes import num_live_blocks
from router.app import ROUTER_KEY
from router.config import RouterConfig
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

ADMIN = {"Authorization": "Bearer admin-secret"}
CFG = RouterConfig(health_interval_s=0.05, health_timeout_s=1.0, fail_threshold=2,
                   success_threshold=2, admin_key="admin-secret", retry_backoff_s=0.01)


async def test_admin_routes_need_the_key() -> None:
    async with fake_cluster(CFG, [FakeReplicaConfig()]) as c, aiohttp.ClientSession() as s:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "admin-secret"}):
            async with s.get(f"{c.url}/workers", headers=headers) as resp:
                assert resp.status == 401
                assert (await resp.json())["error"]["type"] == "authentication_error"
            async with s.post(f"{c.url}/flush_cache", headers=headers) as resp:
                assert resp.status == 401
        async with s.get(f"{c.url}/workers", headers=ADMIN) as resp:
            assert resp.status == 200
            assert [w["url"] for w in (await resp.json())["workers"]] == [c.replicas[0].url]
        async with s.get(f"{c.url}/health") as resp:  # never guarded
            assert resp.status == 200


async def test_add_and_remove_workers_at_run_time() -> None:
    extra = FakeReplica(FakeReplicaConfig(name="extra"))
    extra_url = await extra.start()
    try:
        async with fake_cluster(CFG, [FakeReplicaConfig(name="r0")]) as c, \
                aiohttp.ClientSession() as s:
            router = c.router_app[ROUTER_KEY]
            async with s.post(f"{c.url}/workers", json={"url": extra_url + "/"},
                              headers=ADMIN) as resp:
                assert resp.status == 201 and (await resp.json())["url"] == extra_url
            async with s.post(f"{c.url}/workers", json={"url": extra_url}, headers=ADMIN) as resp:
                assert resp.status == 409
            async with s.post(f"{c.url}/workers", json={"url": "nope"}, headers=ADMIN) as resp:
                assert resp.status == 400
            for i in range(6):  # distinct prompts, idle workers: misses rotate over both
                async with s.post(f"{c.url}/v1/completions", json={"prompt": f"{i}" * 200}):
                    pass
            assert extra.num_requests == 3 and router.index.num_entries(extra_url) > 0
            async with s.delete(f"{c.url}/workers", params={"url": extra_url},
                                headers=ADMIN) as resp:
                assert resp.status == 200
            async with s.delete(f"{c.url}/workers", json={"url": extra_url},
                                headers=ADMIN) as resp:
                assert resp.status == 404
            assert router.index.num_entries(extra_url) == 0  # its index entries are gone
            router.index.check_integrity()
            for i in range(4):
                async with s.post(f"{c.url}/v1/completions", json={"prompt": f"{i}" * 200}):
                    pass
            assert extra.num_requests == 3  # nothing more after removal
    finally:
        await extra.stop()


async def test_health_hysteresis_and_router_health() -> None:
    async with fake_cluster(CFG, [FakeReplicaConfig()]) as c, aiohttp.ClientSession() as s:
        worker = c.router_app[ROUTER_KEY].pool.get(c.replicas[0].url)
        assert worker is not None
        c.replicas[0].healthy = False
        await wait_until(lambda: not worker.healthy)
        assert worker.consecutive_failures >= 2
        async with s.get(f"{c.url}/health") as resp:
            assert resp.status == 503
        async with s.post(f"{c.url}/v1/completions", json={"prompt": "x"}) as resp:
            assert resp.status == 503
        c.replicas[0].healthy = True
        await wait_until(lambda: worker.healthy)
        assert worker.consecutive_successes >= 2
        async with s.get(f"{c.url}/health") as resp:
            assert resp.status == 200


async def test_metrics_per_worker() -> None:
    cfg = RouterConfig(health_interval_s=0.05)
    async with fake_cluster(cfg, [FakeReplicaConfig(name="a"), FakeReplicaConfig(name="b")]) \
            as c, aiohttp.ClientSession() as s:
        prompt = "the same long prompt " * 20
        for _ in range(3):
            async with s.post(f"{c.url}/v1/completions", json={"prompt": prompt}) as resp:
                assert resp.status == 200
        async with s.get(f"{c.url}/metrics") as resp:
            text = await resp.text()
        chosen = next(r.url for r in c.replicas if r.num_requests)
    assert f'radixserve_router:requests_routed_total{{worker="{chosen}"}} 3.0' in text
    assert f'radixserve_router:requests_in_flight{{worker="{chosen}"}} 0.0' in text
    # 2 of the 3 requests matched every block: estimated hit rate 2/3.
    line = next(ln for ln in text.splitlines()
                if ln.startswith(f'radixserve_router:estimated_hit_rate{{worker="{chosen}"}}'))
    assert float(line.split()[-1]) == pytest.approx(2 / 3)


async def test_flush_cache_fans_out() -> None:
    async with fake_cluster(CFG, [FakeReplicaConfig(name="a"), FakeReplicaConfig(name="b")]) \
            as c, aiohttp.ClientSession() as s:
        for r in c.replicas:
            r._lookup_and_insert(list(range(64)), "")
        async with s.post(f"{c.url}/flush_cache", headers=ADMIN) as resp:
            body = await resp.json()
            assert resp.status == 200 and body["success"] is True
            assert set(body["workers"].values()) == {200}
        assert all(num_live_blocks(r.publisher) == 0 for r in c.replicas)
        await c.replicas[1].stop()
        async with s.post(f"{c.url}/flush_cache", headers=ADMIN) as resp:
            assert resp.status == 502 and (await resp.json())["success"] is False


def test_cli_rejects_bad_settings() -> None:
    from router.__main__ import main

    with pytest.raises(SystemExit, match="worker URL"):
        main(["--worker", "not-a-url"])
    with pytest.raises(SystemExit, match="--kv-events needs --policy cache_aware"):
        main(["--policy", "round_robin", "--kv-events"])


async def test_cli_process_serves_and_stops() -> None:
    """`python -m router` as the console script runs it: routes to a replica, stops on TERM."""
    import socket
    import subprocess
    import sys

    replica = FakeReplica(FakeReplicaConfig(name="solo"))
    await replica.start()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "router", "--worker", replica.url,
                             "--port", str(port), "--admin-key", "k", "--log-level", "WARNING"])
    try:
        url = f"http://127.0.0.1:{port}"
        async with aiohttp.ClientSession() as s:
            deadline = asyncio.get_running_loop().time() + 30
            while True:
                try:
                    async with s.get(f"{url}/health") as resp:
                        if resp.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    assert asyncio.get_running_loop().time() < deadline, "router never came up"
                    await asyncio.sleep(0.1)
            async with s.post(f"{url}/v1/completions", json={"prompt": "hi"}) as resp:
                assert resp.status == 200 and resp.headers["X-Fake-Replica"] == "solo"
    finally:
        proc.terminate()
        assert proc.wait(timeout=15) == 0  # run_app turns SIGTERM into a graceful exit
        await replica.stop()
