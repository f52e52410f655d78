"""The shared tier shared safely: replicas of different models and bounds on one
--kv-shared-dir each hit as with a directory of their own (their blocks live in their model's
namespace), and no replica deletes a block another one read within the last minute (the read
sets the file's mtime; the evicting replica only forgets such a block)."""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

from radixserve.cache.tiers import BlockStore, Fingerprint, Tier, block_key
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
    assert keys[0] not in small.keys()  # forgotten by the small one (over its bound otherwise)
    small.refresh()
    assert keys[0] not in small.keys()  # and not indexed again while it is in recent use
    for key in keys[8:12]:  # the small replica writes on: its own blocks are young, kept too
        small.put(key, PAYLOAD)
    assert all(big.path(k).exists() for k in keys[4:12])
    small.check_integrity()
