"""The KV tier stores (radixserve/cache/tiers): keys, round trips, LRU bound, warm restart, and
every fault the issue names (corrupt, truncated, deleted under a reader, wrong fingerprint,
disk full, two writers, a writer SIGKILLed mid-write). Processes: tests/cache/tiers/test_block_store_procs.py;
the stateful model test: tests/cache/tiers/test_block_store_stateful.py."""

from __future__ import annotations

import errno
import os
import shutil
import stat
import threading
from pathlib import Path

import pytest
import torch

from radixserve.cache.tiers import (
    BlockStore,
    Fingerprint,
    HostStore,
    MissReason,
    StoreStatus,
    Tier,
    block_key,
)
from tests.cache.tiers.block_stores import BLOCK, FP, PAYLOAD, key, payload, store


def test_block_key_mixes_hash_and_every_fingerprint_field() -> None:
    k = block_key(12345, FP)
    assert k == block_key(12345, FP) and len(k) == 32 and all(c in "0123456789abcdef" for c in k)
    assert block_key(12346, FP) != k
    fields = {"model": "other", "dtype": "bfloat16", "num_layers": 31, "num_kv_heads": 4,
              "head_dim": 32, "block_size": 32}
    for name, value in fields.items():
        other = Fingerprint(**{**FP.__dict__, name: value})
        assert other.digest() != FP.digest() and block_key(12345, other) != k, name
    with pytest.raises(ValueError):
        block_key(-1, FP)


def test_round_trip_exists_and_stats(tmp_path: Path) -> None:
    s = store(tmp_path)
    assert s.tier is Tier.LOCAL and not s.contains(key(0))
    assert s.put(key(0), payload(0)) is StoreStatus.STORED
    assert s.put(key(1), memoryview(payload(1))) is StoreStatus.STORED
    assert s.put(key(0), payload(0)) is StoreStatus.EXISTS
    assert s.contains(key(0)) and sorted(s.keys()) == sorted([key(0), key(1)])
    r = s.get(key(0))
    assert r.hit and r.data == payload(0) and r.miss is None
    assert s.get(key(2)).miss is MissReason.ABSENT
    st_ = s.stats()
    assert (st_.num_blocks, st_.bytes_used, st_.hits, st_.misses) == (2, 2 * BLOCK, 1, 1)
    assert st_.stored_bytes_total == 2 * PAYLOAD and st_.loaded_bytes_total == PAYLOAD
    assert st_.errors == {}
    s.delete(key(0))
    assert not s.contains(key(0)) and not s.path(key(0)).exists()
    s.check_integrity()


def test_files_are_0600_and_dir_0700(tmp_path: Path) -> None:
    s = store(tmp_path / "tier")
    s.put(key(0), payload(0))
    assert stat.S_IMODE(s.path(key(0)).stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "tier").stat().st_mode) == 0o700


def test_lru_eviction_order_and_take_evicted(tmp_path: Path) -> None:
    s = store(tmp_path, blocks=3)
    for i in range(3):
        assert s.put(key(i), payload(i)) is StoreStatus.STORED
    assert s.get(key(0)).hit  # 0 is now the most recent; 1 is the oldest
    assert s.put(key(3), payload(3)) is StoreStatus.STORED
    assert s.take_evicted() == [key(1)] and s.take_evicted() == []
    assert not s.path(key(1)).exists() and s.get(key(1)).miss is MissReason.ABSENT
    s.put(key(4), payload(4))
    s.put(key(5), payload(5))
    assert s.take_evicted() == [key(2), key(0)]
    assert s.stats().bytes_used == 3 * BLOCK
    s.check_integrity()


def test_block_bigger_than_capacity_is_no_space(tmp_path: Path) -> None:
    s = store(tmp_path, blocks=1)
    assert s.put(key(0), payload(0, 2 * PAYLOAD)) is StoreStatus.NO_SPACE
    assert s.stats().errors == {"no_space": 1} and s.keys() == []


def test_warm_restart_sees_blocks_in_mtime_order(tmp_path: Path) -> None:
    s = store(tmp_path)
    for i in range(4):
        s.put(key(i), payload(i))
        os.utime(s.path(key(i)), (1000 + i, 1000 + i))
    os.utime(s.path(key(0)), (2000, 2000))  # 0 was the most recently used
    again = store(tmp_path)
    assert sorted(again.keys()) == sorted(key(i) for i in range(4))
    assert all(again.get(key(i)).data == payload(i) for i in range(4))
    small = store(tmp_path, blocks=2)  # a restart with less room keeps the newest
    assert small.keys() == [key(3), key(0)]
    assert sorted(small.take_evicted()) == sorted([key(1), key(2)])
    assert not s.path(key(1)).exists()
    small.check_integrity()
    assert store(tmp_path, scan=False).keys() == []


@pytest.mark.parametrize("tier", [Tier.LOCAL, Tier.SHARED])
def test_corrupted_byte_is_a_miss(tmp_path: Path, tier: Tier) -> None:
    s = store(tmp_path, tier=tier)
    s.put(key(0), payload(0))
    path = s.path(key(0))
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))
    r = s.get(key(0))
    assert r.data is None and r.miss is MissReason.CORRUPT
    assert not s.contains(key(0)) and s.stats().errors == {"corrupt": 1}
    assert path.exists() == (tier is Tier.SHARED)  # never unlink what another replica may fix
    s.check_integrity()


def test_truncated_file_is_a_miss(tmp_path: Path) -> None:
    s = store(tmp_path)
    s.put(key(0), payload(0))
    with open(s.path(key(0)), "r+b") as f:
        f.truncate(BLOCK - 100)
    assert s.get(key(0)).miss is MissReason.TRUNCATED
    assert not s.contains(key(0)) and not s.path(key(0)).exists()
    s.put(key(0), payload(0))  # the key can be stored again
    assert s.get(key(0)).data == payload(0)


def test_file_deleted_between_contains_and_get(tmp_path: Path) -> None:
    s = store(tmp_path)
    s.put(key(0), payload(0))
    assert s.contains(key(0))
    os.unlink(s.path(key(0)))
    assert s.get(key(0)).miss is MissReason.ABSENT
    assert not s.contains(key(0)) and s.stats().errors == {"vanished": 1}
    s.check_integrity()


def test_wrong_fingerprint_or_key_is_a_miss(tmp_path: Path) -> None:
    other = Fingerprint("smollm2-135m", "bfloat16", 30, 3, 64, 16)
    theirs = BlockStore(tmp_path / "b", 8 * BLOCK, other, Tier.SHARED, durable=False)
    theirs.put(key(0), payload(0))  # a block of another dtype filed under our key's name
    theirs.put(key(5, other), payload(5))  # and one under its own key
    mine = store(tmp_path / "a", tier=Tier.SHARED)
    os.link(theirs.path(key(0)), mine.path(key(0)))
    mine.put(key(1), payload(1))
    os.replace(mine.path(key(1)), mine.path(key(2)))  # key 1's bytes under key 2's name
    mine.refresh()
    assert mine.get(key(0)).miss is MissReason.WRONG_KEY
    assert mine.get(key(2)).miss is MissReason.WRONG_KEY
    assert mine.stats().errors == {"wrong_key": 2}
    # the same directory for two fingerprints: their keys never meet
    both = BlockStore(tmp_path / "b", 8 * BLOCK, FP, Tier.SHARED, durable=False)
    assert not both.contains(key(5)) and both.contains(key(5, other))
    assert both.get(key(5, other)).miss is MissReason.WRONG_KEY


@pytest.mark.parametrize("fault", ["writev", "fsync", "replace"])
def test_disk_full_and_write_errors_are_clean(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               fault: str) -> None:
    s = BlockStore(tmp_path, 8 * BLOCK, FP, Tier.LOCAL)  # durable: fsync runs
    s.put(key(0), payload(0))
    code = errno.ENOSPC if fault != "replace" else errno.EIO

    def fail(*_: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, fault, fail)
    want = StoreStatus.NO_SPACE if code == errno.ENOSPC else StoreStatus.ERROR
    assert s.put(key(1), payload(1)) is want
    monkeypatch.undo()
    assert not s.contains(key(1)) and sorted(os.listdir(tmp_path)) == [f"{key(0)}.kvb"]
    assert s.stats().errors == {"no_space" if code == errno.ENOSPC else "write_error": 1}
    assert s.get(key(0)).data == payload(0) and s.put(key(1), payload(1)) is StoreStatus.STORED
    s.check_integrity()


def test_two_threads_write_one_block(tmp_path: Path) -> None:
    s = store(tmp_path)
    barrier = threading.Barrier(8)
    results: list[StoreStatus] = []

    def write() -> None:
        barrier.wait()
        results.append(s.put(key(0), payload(0)))

    threads = [threading.Thread(target=write) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results.count(StoreStatus.STORED) == 1 and results.count(StoreStatus.EXISTS) == 7
    assert os.listdir(tmp_path) == [f"{key(0)}.kvb"]  # no temp file left behind
    assert s.get(key(0)).data == payload(0)
    s.check_integrity()


def test_shared_tier_sees_other_writers_after_refresh(tmp_path: Path) -> None:
    a, b = store(tmp_path, tier=Tier.SHARED), store(tmp_path, tier=Tier.SHARED)
    a.put(key(0), payload(0))
    assert not b.contains(key(0))
    b.refresh()
    assert b.contains(key(0)) and b.get(key(0)).data == payload(0)
    a.delete(key(0))  # another replica deletes it: a miss here, and forgotten
    assert b.get(key(0)).miss is MissReason.ABSENT and not b.contains(key(0))
    a.put(key(1), payload(1))
    b.refresh()
    os.unlink(a.path(key(1)))
    b.check_integrity()  # tolerated on the shared tier: dropped and reported
    assert not b.contains(key(1)) and b.take_evicted() == [key(1)]
    a.refresh()
    assert a.keys() == [] and a.take_evicted() == [key(1)]


def test_refresh_of_a_vanished_directory_is_counted_not_raised(tmp_path: Path) -> None:
    s = store(tmp_path / "tier", tier=Tier.SHARED)
    s.put(key(0), payload(0))
    shutil.rmtree(tmp_path / "tier")
    s.refresh()
    assert s.stats().errors == {"scan_error": 1}
    assert s.get(key(0)).miss is MissReason.ABSENT
    assert s.put(key(1), payload(1)) is StoreStatus.ERROR  # the directory is gone


def test_local_integrity_forgets_a_missing_or_cut_file(tmp_path: Path) -> None:
    s = store(tmp_path)
    s.put(key(0), payload(0))
    s.put(key(1), payload(1))
    os.unlink(s.path(key(0)))
    with open(s.path(key(1)), "r+b") as f:
        f.truncate(10)
    s.check_integrity()  # a disk fault is a miss: dropped and reported, not a failed check
    assert s.keys() == [] and sorted(s.take_evicted()) == sorted([key(0), key(1)])
    assert s.stats().errors.get("truncated") == 1


def test_young_temp_files_survive_old_ones_are_cleaned(tmp_path: Path) -> None:
    s = store(tmp_path, tier=Tier.SHARED)
    young, old = tmp_path / f".{key(0)}.1.2.aa.tmp", tmp_path / f".{key(1)}.1.2.bb.tmp"
    young.write_bytes(b"x" * 10)
    old.write_bytes(b"x" * 10)
    os.utime(old, (1, 1))
    for i in range(10):
        s.put(key(i + 2), payload(i))  # eviction never touches temp files
    s.refresh()
    assert young.exists() and not old.exists()
    assert not s.contains(key(0)) and not s.contains(key(1))


def test_host_store_round_trip_lru_and_tensors() -> None:
    h = HostStore(3 * PAYLOAD, FP)
    assert h.tier is Tier.LOCAL and h.pinned == torch.cuda.is_available()
    for i in range(3):
        assert h.put(key(i), payload(i)) is StoreStatus.STORED
    assert h.put(key(0), payload(0)) is StoreStatus.EXISTS
    assert h.get(key(0)).data == payload(0)
    t = torch.arange(PAYLOAD // 4, dtype=torch.float32)  # (250,) = 1000 bytes
    assert h.put(key(3), t.numpy().tobytes()) is StoreStatus.STORED
    assert h.take_evicted() == [key(1)] and h.get(key(1)).miss is MissReason.ABSENT
    buf = h.get_buffer(key(3))  # what the loader copies from (pinned on CUDA)
    assert buf is not None and torch.equal(buf.view(torch.float32), t)
    assert h.put(key(9), payload(9, 4 * PAYLOAD)) is StoreStatus.NO_SPACE
    st_ = h.stats()
    assert (st_.num_blocks, st_.bytes_used, st_.hits, st_.misses) == (3, 3 * PAYLOAD, 2, 1)
    h.delete(key(0))
    assert not h.contains(key(0)) and sorted(h.keys()) == sorted([key(2), key(3)])
    h.check_integrity()


@pytest.mark.gpu
def test_host_store_pinned_on_cuda() -> None:
    h = HostStore(4 * PAYLOAD, FP)
    src = torch.arange(PAYLOAD, dtype=torch.uint8, device="cuda")
    assert h.put(key(0), src.cpu().numpy().tobytes()) is StoreStatus.STORED
    buf = h.get_buffer(key(0))
    assert buf is not None and buf.is_pinned()
    assert torch.equal(buf.to("cuda", non_blocking=True), src)
