"""Per-key limits exact across routers through one Redis (router/fleet/redis_limits.py): a real
server (tests/redis_server.py) that the test starts and stops; two routers in front of the
same fake replicas."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import logging
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
import redis.asyncio as aioredis

from radixserve.testing.fake_replica import (
    ByteEncoder,
    FakeReplica,
    FakeReplicaConfig,
    fake_cluster,
    start_app,
)
from router.app import ROUTER_KEY, create_app
from router.config import ConfigError, RouterConfig
from tests.redis_server import RedisProc, running_redis
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(120)

KEY = "sk-tenant-1"
FAST = RouterConfig(health_interval_s=0.05, health_timeout_s=1.0, retry_backoff_s=0.01,
                    router_replicas=2)


@dataclasses.dataclass
class Fleet:
    urls: list[str]  # the two routers
    redis: RedisProc
    apps: list[Any]
    replicas: list[FakeReplica]


@contextlib.asynccontextmanager
async def fleet(tmp: Path, decode_s: float = 0.0, **limits: int) -> AsyncIterator[Fleet]:
    keys = tmp / "keys.json"
    keys.write_bytes(orjson.dumps({"keys": [{"name": "tenant-1", "key": KEY, **limits}]}))
    with running_redis(tmp / "redis.log") as server:
        cfg = dataclasses.replace(FAST, api_keys_file=str(keys), redis_url=server.url)
        rcfg = [FakeReplicaConfig(name=f"r{i}", decode_s_per_token=decode_s) for i in range(2)]
        async with fake_cluster(cfg, rcfg) as c:
            app = create_app(dataclasses.replace(cfg, workers=tuple(r.url for r in c.replicas)),
                             encoder=ByteEncoder())
            runner, url = await start_app(app)
            try:
                yield Fleet([c.url, url], server, [c.router_app, app], c.replicas)
            finally:
                await runner.cleanup()


async def post(s: aiohttp.ClientSession, url: str, i: int, max_tokens: int = 2
               ) -> aiohttp.ClientResponse:
    async with s.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                      json={"prompt": f"request {i}", "max_tokens": max_tokens}) as resp:
        await resp.read()
        return resp


async def metric(s: aiohttp.ClientSession, url: str, name: str) -> float:
    async with s.get(f"{url}/metrics") as resp:
        text = await resp.text()
    m = re.search(rf"^radixserve_router:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
    assert m is not None, (name, text)
    return float(m.group(1))


@pytest.mark.parametrize("on_first", [6, 10])
async def test_rpm_6_over_two_routers_serves_exactly_6_of_12(tmp_path: Path,
                                                              on_first: int) -> None:
    async with fleet(tmp_path, rpm=6) as f, aiohttp.ClientSession() as s:
        targets = [f.urls[0]] * on_first + [f.urls[1]] * (12 - on_first)
        answers = await asyncio.gather(*(post(s, u, i) for i, u in enumerate(targets)))
        assert sorted(r.status for r in answers) == [200] * 6 + [429] * 6
        for r in answers:
            if r.status == 429:
                assert int(r.headers["Retry-After"]) >= 1
                assert r.headers["x-ratelimit-limit-requests"] == "6"
                assert r.headers["x-ratelimit-remaining-requests"] == "0"
        client = aioredis.Redis.from_url(f.redis.url)
        try:
            names = [k.decode() for k in await client.keys("*")]
            ttls = [await client.ttl(n) for n in names]
        finally:
            await client.aclose()
        assert names and all(KEY not in n and n.startswith("radixserve:limits:") for n in names)
        assert all(0 < t <= 61 for t in ttls)  # every key expires


async def test_concurrency_is_fleet_wide_and_slots_come_back(tmp_path: Path) -> None:
    conc = f"radixserve:limits:{hashlib.sha256(KEY.encode()).hexdigest()}:conc"
    async with fleet(tmp_path, decode_s=0.1, max_concurrency=2) as f, \
            aiohttp.ClientSession() as s:
        client = aioredis.Redis.from_url(f.redis.url)
        try:
            tasks = [asyncio.create_task(post(s, f.urls[i % 2], i, max_tokens=5))
                     for i in range(6)]
            await asyncio.sleep(0.25)
            assert await client.zcard(conc) == 2  # two slots held, one per request
            answers = await asyncio.gather(*tasks)
            assert sorted(r.status for r in answers) == [200, 200, 429, 429, 429, 429]
            assert await client.zcard(conc) == 0  # every slot released
        finally:
            await client.aclose()
        for url in f.urls:
            assert await metric(s, url, "key_requests_in_flight") == 0
        again = await asyncio.gather(*(post(s, f.urls[i % 2], i) for i in range(2)))
        assert [r.status for r in again] == [200, 200]


async def test_redis_stopped_mid_run_never_gives_a_5xx(tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, "router.fleet.redis_limits")
    async with fleet(tmp_path, decode_s=0.1, rpm=6) as f, aiohttp.ClientSession() as s:
        first = [asyncio.create_task(post(s, f.urls[i % 2], i, max_tokens=5))
                 for i in range(6)]
        # Admitted through Redis, now running on the replicas.
        await wait_until(lambda: sum(r.num_requests for r in f.replicas) == 6)
        assert all(app[ROUTER_KEY].limits.redis.num_fallbacks == 0 for app in f.apps)
        f.redis.stop()
        rest = await asyncio.gather(*(post(s, f.urls[i % 2], i) for i in range(6, 12)))
        answers = [*await asyncio.gather(*first), *rest]
        assert all(r.status in (200, 429) for r in answers), [r.status for r in answers]
        assert [r.status for r in answers[:6]] == [200] * 6
        assert sum(r.status == 200 for r in rest) == 6  # each router's share: 6 // 2
        for url in f.urls:
            assert await metric(s, url, "key_limits_redis_up") == 0
            assert await metric(s, url, "key_limits_redis_fallbacks_total") >= 3
            assert await metric(s, url, "key_requests_in_flight") == 0
    warnings = [r for r in caplog.records if "unreachable" in r.getMessage()]
    assert 1 <= len(warnings) <= 2  # once per router


def test_redis_url_is_checked() -> None:
    with pytest.raises(ConfigError, match="redis://"):
        RouterConfig(redis_url="http://x:1", api_keys_file="k.json")
    with pytest.raises(ConfigError, match="api-keys-file"):
        RouterConfig(redis_url="redis://127.0.0.1:6379/0")
    assert RouterConfig(redis_url="redis://127.0.0.1:6379/0", api_keys_file="k").redis_url


def test_router_counts_in_redis_only_with_the_flag() -> None:
    from router.__main__ import build_parser, config_from_args

    args = ["--api-keys-file", "k.json", "--redis-url", "redis://127.0.0.1:6390/2"]
    assert config_from_args(build_parser().parse_args(args)).redis_url == \
        "redis://127.0.0.1:6390/2"
    assert config_from_args(build_parser().parse_args(args[:2])).redis_url is None
