"""The router over HTTP against fake replicas: routing, balance, streaming, failover, 503."""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter
from typing import Any

import aiohttp
import pytest

from radixserve.testing.fake_replica import FakeCluster, FakeReplicaConfig, fake_cluster
from router.app import ROUTER_KEY
from router.config import PolicyName, RouterConfig
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

FAST = RouterConfig(health_interval_s=0.05, health_timeout_s=1.0, retry_backoff_s=0.01)


def replicas(n: int, **kw: Any) -> list[FakeReplicaConfig]:
    return [FakeReplicaConfig(name=f"r{i}", **kw) for i in range(n)]


async def complete(session: aiohttp.ClientSession, url: str, prompt: str,
                   **extra: Any) -> tuple[str, dict[str, Any]]:
    async with session.post(f"{url}/v1/completions",
                            json={"prompt": prompt, "max_tokens": 2, **extra}) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers["X-Fake-Replica"], await resp.json()


def served_by(cluster: FakeCluster) -> dict[str, int]:
    return {r.cfg.name: r.num_requests for r in cluster.replicas}


@pytest.mark.parametrize("policy", list(PolicyName))
async def test_each_policy_routes_over_http(policy: PolicyName) -> None:
    cfg = RouterConfig(policy=policy, health_interval_s=0.05)
    async with fake_cluster(cfg, replicas(3)) as c, aiohttp.ClientSession() as s:
        names = [(await complete(s, c.url, f"prompt {i} " * 20))[0] for i in range(12)]
    counts = Counter(names)
    if policy is PolicyName.ROUND_ROBIN:
        assert names[:6] == ["r0", "r1", "r2", "r0", "r1", "r2"]
    elif policy is PolicyName.RANDOM:
        assert len(counts) >= 2
    else:  # sequential requests, all loads 0, distinct prompts: ties rotate
        assert counts == {"r0": 4, "r1": 4, "r2": 4}


async def test_cache_aware_sticks_to_the_prefix_and_reports_cached_tokens() -> None:
    async with fake_cluster(FAST, replicas(3)) as c, aiohttp.ClientSession() as s:
        system = "You are a careful assistant. " * 10
        first, _ = await complete(s, c.url, system + "question one")
        for q in ("two", "three", "four"):
            name, body = await complete(s, c.url, system + "question " + q)
            assert name == first
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] >= 256
        other, _ = await complete(s, c.url, "an unrelated prompt " * 10)
        assert other != first  # a miss goes to the least loaded (rotation), not the same one


async def test_skewed_workload_is_balanced() -> None:
    # 90% of requests share one long prefix. With 16 in flight, the hot worker must not take
    # everything: once it is busy enough the prefix replicates to other workers.
    cfg = RouterConfig(health_interval_s=0.05)
    rcfg = replicas(4, prefill_s_per_token=2e-5, decode_s_per_token=0.004, default_max_tokens=4)
    hot = "shared system prompt " * 40
    prompts = [hot + f"q{i}" if i % 10 else f"cold {i} " * 40 for i in range(160)]
    sem = asyncio.Semaphore(16)
    async with fake_cluster(cfg, rcfg) as c, aiohttp.ClientSession() as s:
        async def one(p: str) -> str:
            async with sem:
                return (await complete(s, c.url, p))[0]

        names = await asyncio.gather(*(one(p) for p in prompts))
        hits = sum(r.cached_tokens for r in c.replicas) / sum(r.prompt_tokens for r in c.replicas)
    counts = Counter(names)
    assert len(counts) == 4, counts
    assert max(counts.values()) < 0.6 * len(prompts), counts
    assert hits > 0.5, hits  # the hot prefix still hits nearly everywhere


async def test_streaming_passes_through_chunk_by_chunk() -> None:
    rcfg = replicas(1, decode_s_per_token=0.1, default_max_tokens=4)
    async with fake_cluster(FAST, rcfg) as c, aiohttp.ClientSession() as s:
        start = time.monotonic()
        async with s.post(f"{c.url}/v1/completions",
                          json={"prompt": "hello", "stream": True}) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/event-stream")
            assert resp.headers["X-Fake-Replica"] == "r0"
            stamps, lines = [], []
            async for line in resp.content:
                if line.startswith(b"data: "):
                    stamps.append(time.monotonic() - start)
                    lines.append(line)
    assert lines[-1].strip() == b"data: [DONE]" and len(lines) == 6
    # Token i is written at ~0.1 * i s; a buffering proxy would deliver them all at the end.
    assert stamps[3] - stamps[0] > 0.2, stamps


async def test_client_leaving_mid_stream_aborts_the_replica_stream() -> None:
    rcfg = replicas(1, decode_s_per_token=0.1, default_max_tokens=30)
    async with fake_cluster(FAST, rcfg) as c:
        worker = c.router_app[ROUTER_KEY].pool.get(c.replicas[0].url)
        assert worker is not None
        async with aiohttp.ClientSession() as s:
            resp = await s.post(f"{c.url}/v1/completions", json={"prompt": "x", "stream": True})
            await resp.content.readline()
            assert worker.in_flight == 1
            resp.close()  # the client goes away ~2.9 s before the stream would end
        await wait_until(lambda: not worker.in_flight and c.replicas[0].num_aborted > 0,
                         what="the replica stream aborted")
        assert worker.in_flight == 0 and c.replicas[0].num_aborted == 1


async def test_status_headers_and_auth_pass_through() -> None:
    async with fake_cluster(FAST, replicas(1)) as c, aiohttp.ClientSession() as s:
        async with s.post(f"{c.url}/v1/completions", data=b"{not json",
                          headers={"Authorization": "Bearer sk-user"}) as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["type"] == "invalid_request_error"
        async with s.get(f"{c.url}/v1/models") as resp:
            assert resp.status == 200 and (await resp.json())["data"][0]["id"] == "r0"
    assert c.replicas[0].auth_seen == []  # the 400 came before the replica read a key
    async with fake_cluster(FAST, replicas(1)) as c, aiohttp.ClientSession() as s:
        await complete(s, c.url, "x", stream=False)
        async with s.post(f"{c.url}/generate", json={"text": "abc"},
                          headers={"Authorization": "Bearer sk-user"}) as resp:
            assert resp.status == 200
    assert c.replicas[0].auth_seen == [None, "Bearer sk-user"]


async def test_dead_replica_is_routed_around_without_losing_requests() -> None:
    rcfg = replicas(2, decode_s_per_token=0.01, default_max_tokens=3)
    with socket.socket() as sock:  # a port nobody listens on: connection refused
        sock.bind(("127.0.0.1", 0))
        dead_url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    async with fake_cluster(FAST, rcfg) as c, aiohttp.ClientSession() as s:
        dead = c.router_app[ROUTER_KEY].add_worker(dead_url)
        results = await asyncio.gather(*(complete(s, c.url, f"p{i} " * 30) for i in range(24)))
        assert {name for name, _ in results} <= {"r0", "r1"} and len(results) == 24
        assert dead.num_routed >= 1 and dead.num_errors >= 1  # it was tried, then avoided
        assert "ConnectorError" in (dead.last_error or "")
        await wait_until(lambda: not dead.healthy, what="the dead worker marked down")


async def test_replica_killed_mid_run_loses_no_unstreamed_request() -> None:
    rcfg = replicas(3, decode_s_per_token=0.02, default_max_tokens=5)
    async with fake_cluster(FAST, rcfg) as c, aiohttp.ClientSession() as s:
        tasks = [asyncio.create_task(complete(s, c.url, f"k{i} " * 30)) for i in range(30)]
        victim = c.router_app[ROUTER_KEY].pool.get(c.replicas[0].url)
        assert victim is not None
        while not victim.in_flight:
            await asyncio.sleep(0.005)
        await c.replicas[0].stop()  # its in-flight, not yet answered requests are cut
        results = await asyncio.gather(*tasks)
        assert victim.num_errors >= 1  # the router saw them fail, and retried them
    assert len(results) == 30  # every one answered 200 (complete() asserts it)


async def test_stream_broken_mid_way_reaches_the_client_and_is_not_retried() -> None:
    rcfg = replicas(2, decode_s_per_token=0.01, default_max_tokens=5)
    async with fake_cluster(FAST, rcfg) as c, aiohttp.ClientSession() as s:
        for r in c.replicas:
            r.break_after_chunks = 1
        with pytest.raises(aiohttp.ClientPayloadError):
            async with s.post(f"{c.url}/v1/completions",
                              json={"prompt": "x", "stream": True}) as resp:
                assert resp.status == 200
                await resp.read()
        assert sum(served_by(c).values()) == 1


async def test_503_when_no_worker() -> None:
    async with fake_cluster(FAST, []) as c, aiohttp.ClientSession() as s:
        async with s.post(f"{c.url}/v1/chat/completions",
                          json={"messages": [{"role": "user", "content": "hi"}]}) as resp:
            assert resp.status == 503
            err = (await resp.json())["error"]
            assert set(err) == {"message", "type", "param", "code"}
            assert err["code"] == "no_worker_available"
        async with s.get(f"{c.url}/health") as resp:
            assert resp.status == 503


async def test_replica_answering_503_is_retried_elsewhere_then_passed_through() -> None:
    async with fake_cluster(FAST, replicas(2)) as c, aiohttp.ClientSession() as s:
        c.replicas[0].healthy = False  # answers 503 (engine dead) until probes mark it down
        names = [(await complete(s, c.url, f"z{i}"))[0] for i in range(4)]
        assert set(names) == {"r1"}
        c.replicas[1].healthy = False
        c.router_app[ROUTER_KEY].pool.get(c.replicas[0].url).suspect = False  # type: ignore[union-attr]
        async with s.post(f"{c.url}/v1/completions", json={"prompt": "q"}) as resp:
            # Both answer 503 now: the replica's own 503 comes back, or the router's.
            assert resp.status == 503 and "error" in await resp.json()


async def test_tokenize_is_forwarded_to_a_replica() -> None:
    async with fake_cluster(FAST, replicas(2)) as c, aiohttp.ClientSession() as s:
        async with s.post(f"{c.url}/tokenize", json={"prompt": "hello"}) as resp:
            assert resp.status == 200
            assert resp.headers["X-Fake-Replica"] in ("r0", "r1")
            body = await resp.json()
    assert body["count"] == len(body["tokens"]) > 0
