"""The shared tier shared safely: replicas of different models and bounds on one
--kv-shared-dir each hit as with a directory of their own (their blocks live in their model's
namespace), no replica deletes a block another one read within the last minute (the read
sets the file's mtime; the evicting replica holds such a block: still counted, not deleted),
and the bytes a replica counts, held blocks included, stay within its bound (so a replica
alone keeps the directory within it)."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

from radixserve.cache.tiers import BlockStore, Fingerprint, StoreStatus, Tier, block_key
from radixserve.cache.tiers.block_store import RECENT_S
from radixserve.cache.tiers.kv_tiers import shared_namespace

FP_A = Fingerprint("model-a#1", "float32", 2, 1, 64, 16)
FP_B = Fingerprint("model-b#2", "bfloat16", 4, 2, 32, 16)
PAYLOAD = b"\x5a" * 512


def shared(root: Path, fp: Fingerprint, num_blocks: int) -> BlockStore:
    size = num_blocks * (len(PAYLOAD) + 128)  # the header and checksum fit in 128 bytes
    return BlockStore(shared_namespace(root, fp), size, fp, Tier.SHARED, durable=False)


def trace(seed: int, n: int = 1500, universe: int = 120) -> list[int]:
    rng = random.Random(seed)
    return [min(int(rng.paretovariate(1.2)), universe) for _ in range(n)]


def hit_rate(store: BlockStore, fp: Fingerprint, ids: list[int]) -> float:
    hits = 0
    for i in ids:
        key = block_key(i, fp)
        if store.contains(key) and store.get(key).hit:
            hits += 1
        else:
            store.put(key, PAYLOAD)
    return hits / len(ids)


def test_two_models_with_different_bounds_on_one_directory(tmp_path: Path) -> None:
    ids_a, ids_b = trace(1), trace(2)
    own_a = hit_rate(shared(tmp_path / "own-a", FP_A, 40), FP_A, ids_a)
    own_b = hit_rate(shared(tmp_path / "own-b", FP_B, 10), FP_B, ids_b)
    a, b = shared(tmp_path / "one", FP_A, 40), shared(tmp_path / "one", FP_B, 10)
    hits = {"a": 0, "b": 0}
    for step in range(0, len(ids_a), 100):  # interleaved, re-scanning like the writer does
        hits["a"] += round(hit_rate(a, FP_A, ids_a[step:step + 100]) * 100)
        hits["b"] += round(hit_rate(b, FP_B, ids_b[step:step + 100]) * 100)
        a.refresh(full=False)
        b.refresh(full=False)
    assert hits["a"] / len(ids_a) == own_a and hits["b"] / len(ids_b) == own_b
    assert 0 < own_b < own_a  # the bounds differ, and so do the rates
    assert not set(a.keys()) & set(b.keys())
    a.check_integrity()
    b.check_integrity()
    assert a.take_evicted() and not [k for k in b.take_evicted() if k in a.keys()]


def test_no_replica_deletes_a_block_another_read_in_the_last_minute(tmp_path: Path) -> None:
    big, small = shared(tmp_path, FP_A, 100), shared(tmp_path, FP_A, 4)
    keys = [block_key(i, FP_A) for i in range(1, 13)]
    for key in keys[:4]:
        big.put(key, PAYLOAD)
    small.refresh()
    past = time.time() - 2 * RECENT_S
    for key in keys[:4]:  # nobody used them for two minutes ...
        os.utime(big.path(key), (past, past))
    assert big.get(keys[0]).hit  # ... but the big replica reads one of them now
    for key in keys[4:8]:  # the small replica needs room: four victims
        small.put(key, PAYLOAD)
    assert big.path(keys[0]).exists() and big.get(keys[0]).hit  # read recently: kept
    assert not any(big.path(k).exists() for k in keys[1:4])  # idle for two minutes: deleted
    assert keys[0] not in small.keys()  # held by the small one: counted, no longer read
    small.refresh()
    assert keys[0] not in small.keys()  # and not indexed again while it is in recent use
    for key in keys[8:12]:  # its own blocks, used by no other replica: its LRU deletes them
        assert small.put(key, PAYLOAD) is StoreStatus.STORED
    # The bound is four blocks, keys[0] (held) included: its three newest remain.
    assert big.path(keys[0]).exists() and all(big.path(k).exists() for k in keys[9:12])
    assert not any(big.path(k).exists() for k in keys[4:9])
    assert small.stats().bytes_used <= small.stats().capacity_bytes
    small.check_integrity()


def dir_bytes(store: BlockStore) -> int:
    return sum(p.stat().st_size for p in store.root.glob("*.kvb"))


def test_a_replica_alone_keeps_the_directory_within_its_bound(tmp_path: Path) -> None:
    """Its own fresh writes are not "in recent use elsewhere": the LRU deletes them."""
    store = shared(tmp_path, FP_A, 4)
    for i in range(1, 13):  # three times the bound within a second
        assert store.put(block_key(i, FP_A), PAYLOAD) is StoreStatus.STORED
        assert dir_bytes(store) == store.stats().bytes_used <= store.stats().capacity_bytes
    assert store.get(block_key(1, FP_A)).miss is not None  # evicted and deleted
    assert store.get(block_key(12, FP_A)).hit
    store.refresh()
    assert dir_bytes(store) == store.stats().bytes_used
    store.check_integrity()


def test_two_replicas_count_held_blocks_and_stay_within_their_bounds(tmp_path: Path) -> None:
    """A's blocks that B read are held by A (counted by A until deleted); A's count never
    passes its bound, so when only held blocks are left a write is refused; once idle for a
    minute a listing deletes them and A writes again."""
    a, b = shared(tmp_path, FP_A, 6), shared(tmp_path, FP_A, 3)
    keys = [block_key(i, FP_A) for i in range(1, 30)]
    for key in keys[:6]:
        assert a.put(key, PAYLOAD) is StoreStatus.STORED
    b.refresh()  # six new blocks, room for three: the three others are A's (not counted)
    assert len(b.keys()) == 3 and b.stats().bytes_used <= b.stats().capacity_bytes
    read_by_b = b.keys()
    assert all(b.get(k).hit for k in read_by_b)  # B uses them: their mtime is recent
    for key in keys[6:9]:  # A needs room three times: its unread blocks go first ...
        assert a.put(key, PAYLOAD) is StoreStatus.STORED
    for key in keys[9:12]:  # ... then B's are held, and A's own newer ones deleted instead
        assert a.put(key, PAYLOAD) is StoreStatus.STORED
    assert all(a.path(k).exists() and b.get(k).hit for k in read_by_b)  # never deleted
    assert not set(read_by_b) & set(a.keys())  # A no longer reads them, but counts them
    for st in (a.stats(), b.stats()):
        assert st.bytes_used <= st.capacity_bytes, st
    block = a.path(read_by_b[0]).stat().st_size
    assert a.stats().num_blocks == 3 and a.stats().bytes_used == 6 * block  # 3 held
    assert dir_bytes(a) <= a.stats().capacity_bytes + b.stats().capacity_bytes
    for key in keys[12:15]:  # A's own three go; then only held blocks would be left
        a.put(key, PAYLOAD)
    a.get(keys[14])  # A's newest block read, then B reads A's others: all in use elsewhere
    for key in a.keys():
        os.utime(a.path(key))  # what B's read does (B's index does not hold them)
    assert a.put(keys[15], PAYLOAD) is StoreStatus.NO_SPACE  # refused, not over the bound
    assert a.stats().bytes_used <= a.stats().capacity_bytes
    past = time.time() - 2 * RECENT_S
    for key in read_by_b:  # B stops using them: idle for two minutes
        os.utime(a.path(key), (past, past))
    a.refresh()  # the listing deletes A's held blocks that went idle
    assert not any(a.path(k).exists() for k in read_by_b)
    assert a.put(keys[15], PAYLOAD) is StoreStatus.STORED
    a.check_integrity()
    b.refresh()
    assert not set(read_by_b) & set(b.keys())  # deleted behind B: B forgets them
    b.check_integrity()
