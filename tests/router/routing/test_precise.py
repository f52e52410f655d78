"""Precise mode: the router follows fake replicas' real /kv_events streams."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import pytest
from aiohttp import web

from radixserve.api.api_keys import cache_salt_for_api_key
from radixserve.kv_events.publisher import BlockStored, KVEventPublisher, block_hashes, encode_batch
from radixserve.testing.fake_replica import FakeReplicaConfig, fake_cluster, start_app
from router.app import ROUTER_KEY
from router.config import RouterConfig
from router.routing.kv_index import PreciseIndex, follow_kv_events
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

CFG = RouterConfig(kv_events=True, health_interval_s=0.05, kv_stream_timeout_s=2.0)


async def post(s: aiohttp.ClientSession, url: str, prompt: str, key: str | None = None) -> str:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with s.post(f"{url}/v1/completions", json={"prompt": prompt}, headers=headers) as r:
        assert r.status == 200
        return r.headers["X-Fake-Replica"]


async def test_routes_by_what_replicas_announce() -> None:
    prompt = "p" * 64  # 64 byte tokens = 4 blocks of 16
    hashes = set(block_hashes(list(prompt.encode()), 16))
    rcfg = [FakeReplicaConfig(name=f"r{i}", cache_blocks=8) for i in range(2)]
    async with fake_cluster(CFG, rcfg) as c, aiohttp.ClientSession() as s:
        precise = c.router_app[ROUTER_KEY].precise
        assert precise is not None
        r0, r1 = c.replicas
        await wait_until(lambda: precise.is_live(r0.url) and precise.is_live(r1.url))

        def held(url: str) -> set[int]:
            st = precise.state(url)
            return st.hashes if st is not None else set()

        # Stored: r1 caches the prompt (sent to it directly); the router learns it from r1's
        # events alone (its approximate index never saw the prompt) and routes there.
        await post(s, r1.url, prompt)
        await wait_until(lambda: hashes <= held(r1.url))
        assert await post(s, c.url, prompt) == "r1"
        # Removed: r1 evicts it (two other prompts fill its 8 blocks), r0 caches it: the
        # router follows, although its approximate index still says r1.
        await post(s, r1.url, "a" * 64)
        await post(s, r1.url, "b" * 64)
        await wait_until(lambda: not hashes & held(r1.url))
        await post(s, r0.url, prompt)
        await wait_until(lambda: hashes <= held(r0.url))
        assert await post(s, c.url, prompt) == "r0"
        assert r0.cached_tokens >= 64


async def test_salted_hashes_agree_with_the_replica() -> None:
    prompt = "s" * 64
    rcfg = [FakeReplicaConfig(name=f"r{i}") for i in range(2)]
    async with fake_cluster(CFG, rcfg) as c, aiohttp.ClientSession() as s:
        precise = c.router_app[ROUTER_KEY].precise
        assert precise is not None
        r1 = c.replicas[1]
        salted = set(block_hashes(list(prompt.encode()), 16, cache_salt_for_api_key("k1")))
        await wait_until(lambda: precise.is_live(r1.url))
        await post(s, r1.url, prompt, key="k1")
        await wait_until(lambda: salted <= precise.state(r1.url).hashes)  # type: ignore[union-attr]
        assert await post(s, c.url, prompt, key="k1") == "r1"
        # Without the key it is another namespace: a miss, least loaded (rotation starts at r0).
        assert await post(s, c.url, prompt) == "r0"


async def test_unsalting_replica_still_matches_a_keyed_request() -> None:
    """A replica without auth caches everything unsalted; clients still send some key (the
    OpenAI SDK always does). The router tries both chains, so precise routing still hits."""
    prompt = "u" * 64
    plain = set(block_hashes(list(prompt.encode()), 16))
    rcfg = [FakeReplicaConfig(name=f"r{i}", salt_by_key=False) for i in range(2)]
    async with fake_cluster(CFG, rcfg) as c, aiohttp.ClientSession() as s:
        precise = c.router_app[ROUTER_KEY].precise
        assert precise is not None
        r1 = c.replicas[1]
        await wait_until(lambda: precise.is_live(r1.url))
        await post(s, r1.url, prompt, key="EMPTY")
        await wait_until(lambda: plain <= precise.state(r1.url).hashes)  # type: ignore[union-attr]
        assert await post(s, c.url, prompt, key="sk-anything") == "r1"


async def test_follower_replays_from_since_after_reconnect() -> None:
    """The first connection drops after one batch; the second must ask for since=1."""
    pub = KVEventPublisher(block_size=16)
    asked: list[str] = []

    async def handler(request: web.Request) -> web.StreamResponse:
        asked.append(request.query["since"])
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for batch in pub.batches_since(int(request.query["since"])):
            await resp.write(b"data: " + encode_batch(batch) + b"\n\n")
        if len(asked) == 1:
            assert request.transport is not None
            request.transport.close()  # the replica's stream breaks
            return resp
        await asyncio.sleep(30)
        return resp

    app = web.Application()
    app.router.add_get("/kv_events", handler)
    runner, url = await start_app(app)
    index = PreciseIndex(block_size=16, pending_ttl_s=1.0)
    index.add_worker(url)
    pub.publish_blocks([BlockStored((1,), None, (), 16)])
    async with aiohttp.ClientSession() as s:
        task = asyncio.create_task(follow_kv_events(s, url, index, 5.0))
        try:
            await wait_until(lambda: index.state(url).last_seq == 1)  # type: ignore[union-attr]
            pub.publish_blocks([BlockStored((2,), 1, (), 16)])  # published while it is down
            await wait_until(lambda: len(asked) == 2 and index.is_live(url))
            await wait_until(lambda: index.match([1, 2], url) == 2)
            assert asked == ["0", "1"]
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await runner.cleanup()
    assert not index.is_live(url)  # a stopped follower never claims a live stream


def test_a_pool_hit_scores_above_a_tier_hit_above_a_miss() -> None:
    from radixserve.kv_events.publisher import BlockRemoved, EventBatch, decode_batch
    from router.routing.kv_index import TIER_HIT_WEIGHT

    hashes = block_hashes(list(range(64)), 16)  # 4 blocks
    index = PreciseIndex(16, pending_ttl_s=1.0)
    for url in ("pool", "tier", "none"):
        index.add_worker(url)
        index.set_live(url, True)
    toks = tuple(range(64))
    pool = EventBatch(1, (BlockStored(tuple(hashes), None, toks, 16, "CPU"),))
    tier = EventBatch(1, (BlockStored(tuple(hashes), None, toks, 16, "LOCAL_DISK"),))
    index.apply("pool", decode_batch(encode_batch(pool)))  # the medium survives the wire
    index.apply("tier", decode_batch(encode_batch(tier)))
    scores = {u: index.match(hashes, u) for u in ("pool", "tier", "none")}
    assert scores == {"pool": 4, "tier": 4 * TIER_HIT_WEIGHT, "none": 0}
    assert scores["pool"] > scores["tier"] > scores["none"]  # type: ignore[operator]
    # Evicted from the pool but still in the tier: a tier hit; gone from the tier: a miss.
    index.apply("pool", EventBatch(2, (BlockRemoved(tuple(hashes[2:]), "CPU"),
                                       BlockStored(tuple(hashes[2:]), hashes[1], toks[32:], 16,
                                                   "SHARED"))))
    assert index.match(hashes, "pool") == 2 + 2 * TIER_HIT_WEIGHT
    index.apply("pool", EventBatch(3, (BlockRemoved((hashes[3],), "SHARED"),)))
    assert index.match(hashes, "pool") == 2 + TIER_HIT_WEIGHT
