"""Fleet-wide limits (router/fleet/key_limits.py): the replicas' keys file enforced by the router before
routing, shared out over --router-replicas, reloaded on SIGHUP."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from radixserve.testing.fake_replica import FakeReplicaConfig, fake_cluster
from router.app import ROUTER_KEY
from router.config import RouterConfig
from router.fleet.key_limits import estimate_tokens
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

FAST = RouterConfig(health_interval_s=0.05, health_timeout_s=1.0, retry_backoff_s=0.01)
KEY = "sk-tenant-1"


def keys_file(tmp: Path, **limits: int) -> Path:
    path = tmp / "keys.json"
    path.write_bytes(orjson.dumps({"keys": [{"name": "tenant-1", "key": KEY, **limits}]}))
    return path


async def post(s: aiohttp.ClientSession, url: str, i: int, key: str = KEY,
               **extra: Any) -> aiohttp.ClientResponse:
    async with s.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"prompt": f"request {i}", "max_tokens": 2, **extra}) as resp:
        await resp.read()
        return resp


def replicas(n: int, **kw: Any) -> list[FakeReplicaConfig]:
    return [FakeReplicaConfig(name=f"r{i}", **kw) for i in range(n)]


async def test_rpm_6_over_two_replicas_serves_exactly_6_of_12(tmp_path: Path) -> None:
    cfg = dataclasses.replace(FAST, api_keys_file=str(keys_file(tmp_path, rpm=6)))
    async with fake_cluster(cfg, replicas(2)) as c, aiohttp.ClientSession() as s:
        answers = await asyncio.gather(*(post(s, c.url, i) for i in range(12)))
        other = await post(s, c.url, 99, key="sk-not-in-file")  # passes: the replica decides
    statuses = sorted(r.status for r in answers)
    assert statuses == [200] * 6 + [429] * 6
    assert other.status == 200
    served = {r.headers.get("X-Fake-Replica") for r in answers if r.status == 200}
    assert served == {"r0", "r1"}  # spread over both replicas, limited once
    for r in answers:
        if r.status == 429:
            # rpm 6: one request every 10 s; the bucket emptied well under a second ago, so
            # the wait, rounded up to whole seconds, is exactly 10.
            assert r.headers["Retry-After"] == "10"
            assert r.headers["x-ratelimit-limit-requests"] == "6"
            assert r.headers["x-ratelimit-remaining-requests"] == "0"
    assert sum(rep.num_requests for rep in c.replicas) == 7


async def test_each_router_enforces_its_share(tmp_path: Path) -> None:
    cfg = dataclasses.replace(FAST, api_keys_file=str(keys_file(tmp_path, rpm=6)),
                              router_replicas=2)
    async with fake_cluster(cfg, replicas(2)) as c, aiohttp.ClientSession() as s:
        answers = await asyncio.gather(*(post(s, c.url, i) for i in range(12)))
    assert sorted(r.status for r in answers) == [200] * 3 + [429] * 9


async def test_max_concurrency_and_tpm(tmp_path: Path) -> None:
    path = keys_file(tmp_path, max_concurrency=2)
    cfg = dataclasses.replace(FAST, api_keys_file=str(path))
    rcfg = replicas(2, decode_s_per_token=0.05)
    async with fake_cluster(cfg, rcfg) as c, aiohttp.ClientSession() as s:
        answers = await asyncio.gather(*(post(s, c.url, i, max_tokens=10) for i in range(5)))
        assert sorted(r.status for r in answers) == [200, 200, 429, 429, 429]
        codes = set()
        for r in answers:
            if r.status == 429:
                codes.add(r.headers["Retry-After"])
        assert codes == {"1"}
        # Reloaded on SIGHUP: now a tpm of 100 (each request charged prompt/4 + max_tokens).
        path.write_bytes(orjson.dumps({"keys": [{"name": "tenant-1", "key": KEY,
                                                 "tpm": 100}]}))
        os.kill(os.getpid(), signal.SIGHUP)
        limits = c.router_app[ROUTER_KEY].limits
        assert limits is not None
        await wait_until(lambda: limits._caller(f"Bearer {KEY}")[1].share.tpm == 100)  # type: ignore[index]
        statuses = [(await post(s, c.url, i, max_tokens=40)).status for i in range(4)]
        assert statuses == [200, 200, 429, 429]


def test_token_estimate() -> None:
    assert estimate_tokens({"prompt": "x" * 398, "max_tokens": 10}) == 100 + 10
    assert estimate_tokens({"prompt": [1, 2, 3]}) == 3 + 16
    # Text: its JSON's bytes / 4 (here 32 bytes); no max_tokens on chat: nothing added.
    assert estimate_tokens({"messages": [{"role": "user", "content": "hi"}]}) == 32 // 4
    assert estimate_tokens({"messages": [], "max_tokens": 0}) == 1  # never below one token


def test_flags_reach_the_config(tmp_path: Path) -> None:
    from router.__main__ import build_parser, config_from_args, main

    path = keys_file(tmp_path, rpm=6)
    cfg = config_from_args(build_parser().parse_args([
        "--api-keys-file", str(path), "--router-replicas", "3", "--max-resumes", "0",
        "--stream-stall-timeout", "2.5", "--session-load-factor", "1.5"]))
    assert (cfg.api_keys_file, cfg.router_replicas, cfg.max_resumes) == (str(path), 3, 0)
    assert (cfg.stream_stall_timeout_s, cfg.session_load_factor) == (2.5, 1.5)
    for bad in (["--router-replicas", "0"], ["--max-resumes", "-1"],
                ["--session-load-factor", "0.5"], ["--stream-stall-timeout", "0"]):
        with pytest.raises(SystemExit):
            main(bad)
    (tmp_path / "bad.json").write_bytes(b'{"keys": [{"name": "x"}]}')
    with pytest.raises(SystemExit, match="key"):
        main(["--api-keys-file", str(tmp_path / "bad.json")])
