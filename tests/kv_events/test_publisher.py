"""The block hash chain, cache salts, the publisher's conversion/replay, and the SSE route."""

from __future__ import annotations

import asyncio
import os
import random
import struct
import subprocess
import sys
from typing import NamedTuple

import pytest
import xxhash
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from radixserve.api.api_keys import cache_salt_for_api_key
from radixserve.kv_events.publisher import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventDecodeError,
    KVEventPublisher,
    block_hashes,
    decode_batch,
    encode_batch,
)
from radixserve.server.routes.kv_events import setup_kv_events
from radixserve.testing.probes import num_live_blocks
from tests.kv_events.random_inserts import RandomInserts


class FakeCacheEvent(NamedTuple):
    """Same fields as radix_cache.CacheEvent (the publisher duck-types on them)."""

    kind: str
    token_ids: tuple[int, ...]
    prefix_len: int
    salt: str = ""


def reference_hashes(tokens: list[int], bs: int, salt: str) -> list[int]:
    """The documented chain, written from xxhash and struct only."""
    prev = xxhash.xxh64(salt.encode("utf-8"), seed=0).intdigest()
    out = []
    for i in range(len(tokens) // bs):
        block = struct.pack(f"<{bs}i", *tokens[i * bs : (i + 1) * bs])
        prev = xxhash.xxh64(struct.pack("<Q", prev) + block, seed=0).intdigest()
        out.append(prev)
    return out


# --- hashing ---------------------------------------------------------------------------------

def test_block_hash_matches_independent_reference() -> None:
    tokens = list(range(40))
    assert block_hashes(tokens, 16) == reference_hashes(tokens, 16, "")
    assert block_hashes(tokens, 4, "abc") == reference_hashes(tokens, 4, "abc")


def test_block_hash_pinned_values() -> None:
    # Pinned literals: if these change, every deployed router and replica disagree (a silent
    # 0% hit rate); fix the code, never the constants.
    assert block_hashes(list(range(16)), 16) == [0x1850D9841F59D457]
    assert block_hashes(list(range(32)), 16, "k")[1] == 0x55E02262B3E14A8D


def test_block_hash_same_in_another_process() -> None:
    code = (
        "from radixserve.kv_events.publisher import block_hashes;"
        "print(block_hashes(list(range(100, 164)), 16, 'k'))"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True,
        timeout=60,
    ).stdout
    assert out.strip() == str(block_hashes(list(range(100, 164)), 16, "k"))


def test_only_full_blocks_and_chaining() -> None:
    assert block_hashes(list(range(15)), 16) == []
    assert len(block_hashes(list(range(33)), 16)) == 2
    a = block_hashes([1] * 16 + [2] * 16, 16)
    b = block_hashes([9] * 16 + [2] * 16, 16)
    assert a[1] != b[1]  # block 1 is equal, but its hash covers block 0
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0)
    with pytest.raises(OverflowError):
        block_hashes([2**40] * 16, 16)


def test_salt_isolates_every_block() -> None:
    tokens = list(range(64))
    plain, k1, k2 = (block_hashes(tokens, 16, s) for s in ("", "s1", "s2"))
    assert not set(plain) & set(k1) and not set(k1) & set(k2)
    assert block_hashes(tokens, 16, "s1") == k1


def test_cache_salt_for_api_key() -> None:
    assert cache_salt_for_api_key(None) == ""
    salt = cache_salt_for_api_key("sk-one")
    assert salt == cache_salt_for_api_key("sk-one") != cache_salt_for_api_key("sk-two")
    assert len(salt) == 16 and int(salt, 16) >= 0
    assert "sk-one" not in salt


# --- publisher -------------------------------------------------------------------------------

def test_publish_stored_completes_straddling_block() -> None:
    pub = KVEventPublisher(block_size=4)
    path = tuple(range(10))
    # The node holds tokens [6, 10): block [4, 8) ends past 6, so this insert completes it;
    # block [8, 12) is partial and never announced; block [0, 4) was the ancestor's.
    batch = pub.publish([FakeCacheEvent("stored", path, 6, "s")])
    assert batch is not None and batch.seq == 1
    (ev,) = batch.events
    hashes = block_hashes(path, 4, "s")
    assert ev == BlockStored((hashes[1],), hashes[0], (4, 5, 6, 7), 4)
    assert num_live_blocks(pub) == 1


def test_publish_removed_and_cleared() -> None:
    pub = KVEventPublisher(block_size=4)
    path = tuple(range(12))
    pub.publish([FakeCacheEvent("stored", path, 0)])
    hashes = block_hashes(path, 4)
    # Evicting tokens [5, 12) takes blocks 1 and 2 (block 1 lost tokens 5..7).
    batch = pub.publish([FakeCacheEvent("removed", path, 5)])
    assert batch is not None and batch.events == (BlockRemoved((hashes[1], hashes[2])),)
    # Removing again is not announced twice; a partial-only node announces nothing.
    assert pub.publish([FakeCacheEvent("removed", path, 5)]) is None
    assert pub.publish([FakeCacheEvent("stored", (1, 2), 0)]) is None
    cleared = pub.publish([FakeCacheEvent("cleared", (), 0)])
    assert cleared is not None and cleared.events == (AllBlocksCleared(),)
    assert num_live_blocks(pub) == 0 and pub.last_seq == 3


def test_replay_buffer_and_snapshot() -> None:
    pub = KVEventPublisher(block_size=2, max_batches=3)
    for i in range(5):
        pub.publish([FakeCacheEvent("stored", (i, i), 0)])
    assert [b.seq for b in pub.batches_since(3)] == [4, 5]
    assert pub.batches_since(5) == []
    # seq 1 is gone from the buffer (it keeps 3..5): a snapshot of all 5 live blocks instead.
    (snap,) = pub.batches_since(1)
    assert snap.seq == 5 and snap.events[0] == AllBlocksCleared()
    assert isinstance(snap.events[1], BlockStored) and len(snap.events[1].block_hashes) == 5
    # A subscriber ahead of us (this replica restarted) also gets the snapshot.
    assert pub.batches_since(99)[0].seq == 5


def test_encode_decode_roundtrip() -> None:
    batch = EventBatch(7, (
        BlockStored((2**64 - 1, 5), None, tuple(range(8)), 4),
        BlockRemoved((3,)),
        AllBlocksCleared(),
    ))
    assert decode_batch(encode_batch(batch)) == batch
    for bad in (b"{", b'{"seq": 1}', b'{"seq": 1, "events": [{"type": "Nope"}]}'):
        with pytest.raises(KVEventDecodeError):
            decode_batch(bad)


async def test_wait_newer_wakes_on_publish_and_close() -> None:
    pub = KVEventPublisher(block_size=2)
    assert await pub.wait_newer(0, 0.01) is False
    waiter = asyncio.create_task(pub.wait_newer(0, 5.0))
    await asyncio.sleep(0)
    pub.publish([FakeCacheEvent("stored", (1, 2), 0)])
    assert await waiter is True
    waiter = asyncio.create_task(pub.wait_newer(1, 5.0))
    await asyncio.sleep(0)
    pub.close()
    assert await waiter is False


# --- the SSE route ---------------------------------------------------------------------------

async def read_batch(resp: object) -> EventBatch:
    content = resp.content  # type: ignore[attr-defined]
    while True:
        line = await asyncio.wait_for(content.readline(), 5.0)
        assert line, "stream ended"
        if line.startswith(b"data: "):
            return decode_batch(line[len(b"data: "):].strip())


async def test_route_replays_then_follows() -> None:
    pub = KVEventPublisher(block_size=2, keepalive_s=0.05)
    app = web.Application()
    setup_kv_events(app, pub)
    pub.publish([FakeCacheEvent("stored", (1, 2, 3, 4), 0)])
    async with TestClient(TestServer(app)) as client:
        bad = await client.get("/kv_events?since=-1")
        assert bad.status == 400 and "since" in (await bad.json())["error"]["message"]
        resp = await client.get("/kv_events?since=0")
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        first = await read_batch(resp)
        assert first.seq == 1 and first.events[0].block_hashes == tuple(  # type: ignore[union-attr]
            block_hashes([1, 2, 3, 4], 2)
        )
        await asyncio.sleep(0.12)  # at least one keepalive goes by, then a live batch
        pub.publish([FakeCacheEvent("cleared", (), 0)])
        assert await read_batch(resp) == EventBatch(2, (AllBlocksCleared(),))
        resp.close()



@pytest.mark.parametrize("page_size", [1, 4])
def test_publisher_follows_a_real_radix_cache(page_size: int) -> None:
    """Model check: after any mix of inserts, evictions and resets, the publisher's live set
    is exactly the full blocks of what the radix cache still holds."""
    from radixserve.cache.radix_cache import RadixCache

    pub = KVEventPublisher(block_size=4)
    cache = RadixCache(page_size=page_size, on_event=lambda ev: pub.publish([ev]))
    rng = random.Random(page_size)
    inserts = RandomInserts(cache, page_size, rng)
    for step in range(300):
        op = rng.random()
        if op < 0.6:
            n, res = inserts.insert()
            assert res.num_already_cached <= n
        elif op < 0.95:
            cache.evict(rng.randrange(1, 10))
        elif step % 7 == 0:
            cache.reset()
        expected = inserts.expected_blocks(4)
        snap = pub.snapshot().events
        live = set(snap[1].block_hashes) if len(snap) > 1 else set()  # type: ignore[union-attr]
        assert live == expected and num_live_blocks(pub) == len(expected)
        cache.check_integrity()
