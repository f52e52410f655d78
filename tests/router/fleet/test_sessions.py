"""Session affinity (router/fleet/sessions.py): the session id's sources, stickiness within the load
bound, bounded-load spill, a prefix match elsewhere winning over a cacheless last replica, and
the session metrics."""

from __future__ import annotations

import asyncio
import dataclasses
from collections import Counter
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.kv_events.publisher import block_hashes
from radixserve.testing.fake_replica import FakeReplicaConfig, fake_cluster
from router.app import ROUTER_KEY
from router.config import RouterConfig
from router.fleet.sessions import (
    SessionAffinity,
    SessionOutcome,
    load_bound,
    session_id,
)
from router.routing.policy import Candidate
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

FAST = RouterConfig(health_interval_s=0.05, health_timeout_s=1.0, retry_backoff_s=0.01)


def replicas(n: int, **kw: Any) -> list[FakeReplicaConfig]:
    return [FakeReplicaConfig(name=f"r{i}", **kw) for i in range(n)]


async def complete(s: aiohttp.ClientSession, url: str, prompt: str,
                   headers: dict[str, str] | None = None, **extra: Any) -> str:
    async with s.post(f"{url}/v1/completions", headers=headers,
                      json={"prompt": prompt, "max_tokens": 2, **extra}) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers["X-Fake-Replica"]


def test_session_id_order() -> None:
    body = {"prompt_cache_key": "pck", "user": "u", "safety_identifier": "sid"}
    assert session_id("hdr", body) == "hdr"
    assert session_id(None, body) == "pck"
    assert session_id("  ", {"user": "u", "safety_identifier": "sid"}) == "u"
    assert session_id(None, {"safety_identifier": "sid", "user": ""}) == "sid"
    assert session_id(None, {"prompt_cache_key": 3, "user": None}) is None
    assert session_id(None, ["not", "a", "dict"]) is None
    assert len(session_id("x" * 5000, {}) or "") == 512


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=8), st.text(max_size=8),
       st.floats(1.0, 3.0))
def test_spill_never_exceeds_the_bound(loads: list[int], key: str, factor: float) -> None:
    aff = SessionAffinity(max_sessions=10, load_factor=factor)
    cands = [Candidate(f"http://w{i}", load) for i, load in enumerate(loads)]
    url = aff.ring_pick(key, cands)
    bound = load_bound(sum(loads), len(loads), factor)
    assert next(c for c in cands if c.url == url).in_flight + 1 <= bound
    assert aff.ring_pick(key, cands) == url  # deterministic


def test_table_is_bounded_and_spill_keeps_the_home() -> None:
    aff = SessionAffinity(max_sessions=3, load_factor=1.0)
    for i in range(5):
        aff.note(f"s{i}", "http://a", SessionOutcome.NEW)
    assert len(aff) == 3 and aff.last("s0") is None and aff.last("s4") == "http://a"
    busy = [Candidate("http://a", 4), Candidate("http://b", 0)]
    pick = aff.pick("s4", busy)
    assert pick is not None and pick.url == "http://b" and pick.outcome is SessionOutcome.SPILL
    aff.note("s4", pick.url, pick.outcome)
    assert aff.last("s4") == "http://a"  # back home once the burst is over
    idle = [Candidate("http://a", 0), Candidate("http://b", 0)]
    assert aff.pick("s4", idle) == ("http://a", SessionOutcome.HIT)


@pytest.mark.parametrize("where", ["prompt_cache_key", "header", "user", "safety_identifier"])
async def test_forty_requests_of_one_session_land_on_one_replica(where: str) -> None:
    async with fake_cluster(FAST, replicas(4)) as c, aiohttp.ClientSession() as s:
        names = []
        for i in range(40):
            # Prompts with no common prefix: only the session can keep them together.
            prompt = f"{i} unrelated prompt number {i} " * 4
            if where == "header":
                names.append(await complete(s, c.url, prompt, {"X-Session-Id": "agent-7"}))
            else:
                names.append(await complete(s, c.url, prompt, **{where: "agent-7"}))
        other = await complete(s, c.url, "another session's prompt " * 4,
                               prompt_cache_key="agent-8")
        async with s.get(f"{c.url}/metrics") as resp:
            text = await resp.text()
    assert len(set(names)) == 1, Counter(names)
    assert other in {"r0", "r1", "r2", "r3"}
    assert "radixserve_router:session_hits_total 39.0" in text
    assert "radixserve_router:session_spills_total 0.0" in text
    assert 'radixserve_router:session_requests_total{outcome="new"} 2.0' in text


async def test_a_flood_on_one_key_spills_and_starves_nobody() -> None:
    rcfg = replicas(4, decode_s_per_token=0.01, default_max_tokens=10)
    async with fake_cluster(FAST, rcfg) as c, aiohttp.ClientSession() as s:
        router = c.router_app[ROUTER_KEY]
        peak: dict[str, int] = Counter()
        bound_ok = True

        async def watch() -> None:
            nonlocal bound_ok
            while True:
                loads = [w.in_flight for w in router.pool.all()]
                for w in router.pool.all():
                    peak[w.url] = max(peak[w.url], w.in_flight)
                # c * (m + 1) / n bounds every load right after a choice, so c * m / n + 1 always.
                bound_ok &= max(loads) <= load_bound(sum(loads), 4, 1.25) + 1
                await asyncio.sleep(0.002)

        watcher = asyncio.create_task(watch())
        flood = [complete(s, c.url, f"flood {i} " * 8, prompt_cache_key="hot", max_tokens=10)
                 for i in range(40)]
        others = [complete(s, c.url, f"tenant {i} " * 8, prompt_cache_key=f"cold-{i}",
                           max_tokens=10) for i in range(8)]
        names = await asyncio.gather(*flood, *others)
        watcher.cancel()
        counts = router.sessions.counts
    flood_names = Counter(names[:40])
    assert len(names) == 48  # every request answered (complete() asserts 200)
    assert len(flood_names) == 4 and max(flood_names.values()) < 40, flood_names
    assert counts[SessionOutcome.SPILL] > 0 and bound_ok, (counts, peak)


async def test_prefix_match_elsewhere_wins_when_the_session_has_no_cache_there() -> None:
    cfg = dataclasses.replace(FAST, kv_events=True, kv_stream_timeout_s=2.0)
    prompt = "q" * 64
    hashes = set(block_hashes(list(prompt.encode()), 16))
    async with fake_cluster(cfg, replicas(2)) as c, aiohttp.ClientSession() as s:
        router = c.router_app[ROUTER_KEY]
        precise = router.precise
        assert precise is not None
        await wait_until(lambda: all(precise.is_live(r.url) for r in c.replicas))
        home = await complete(s, c.url, "first turn " * 8, prompt_cache_key="sess")
        assert await complete(s, c.url, "second turn " * 8, prompt_cache_key="sess") == home
        other = next(r for r in c.replicas if r.cfg.name != home)
        # The session's replica restarts (its cache is gone); another replica holds this
        # prompt's prefix: the prefix wins, and the session moves there.
        async with s.post(f"{c.replicas[int(home[1])].url}/flush_cache") as resp:
            assert resp.status == 200
        await complete(s, other.url, prompt)
        await wait_until(lambda: hashes <= set(precise.state(other.url).hashes))  # type: ignore[union-attr]
        await wait_until(lambda: not precise.state(  # type: ignore[union-attr]
            c.replicas[int(home[1])].url).hashes)
        assert await complete(s, c.url, prompt, prompt_cache_key="sess") == other.cfg.name
        assert router.sessions.counts[SessionOutcome.MOVED] == 1
        assert router.sessions.last("sess") == other.url
