"""HostStore: KV blocks in host memory with an LRU byte bound (the tier above the disk on CUDA).

Owns: one uint8 buffer per block, their LRU order and byte bound. Buffers are pinned host
memory when CUDA is available (so a load is one async H2D copy straight from it: the loader
reads get_buffer()), plain memory otherwise. Does not know: the disk
tier below it (the tree demotes what take_evicted() reports), what a payload means.

Same contract as BlockStore (put/get/contains/delete/keys/take_evicted/stats/check_integrity)
minus the checksum: host memory is trusted, so a miss here is only ever ABSENT.
Thread safety: one lock guards the index and the buffer map; copies into a new buffer run
outside it. `delay_s` (0 in service) delays every read, as FileOps.delay_s does a file
operation: a test or bench models a slow host layer with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from radixserve.cache.radix_types import Tier
from radixserve.cache.tiers.block_keys import (
    Fingerprint,
    LoadResult,
    MissReason,
    StoreStatus,
)
from radixserve.cache.tiers.lru_index import IndexedStore


class HostStore(IndexedStore):
    def __init__(self, capacity_bytes: int, fp: Fingerprint, tier: Tier = Tier.LOCAL, *,
                 pin: bool | None = None) -> None:
        if tier is Tier.POOL:
            raise ValueError("a HostStore is a LOCAL or SHARED tier, not the pool")
        super().__init__(capacity_bytes, tier)
        self.fp = fp
        self.pinned = torch.cuda.is_available() if pin is None else pin
        self._bufs: dict[str, torch.Tensor] = {}  # key -> (nbytes,) uint8, pinned on CUDA
        self.delay_s = 0.0  # injected per read (tests, benches)

    def _alloc(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)  # (nbytes,)

    # -- put -----------------------------------------------------------------------------------

    def put(self, key: str, payload: bytes | memoryview) -> StoreStatus:
        view = memoryview(payload).cast("B")
        src = np.frombuffer(view, dtype=np.uint8)  # (nbytes,), no copy

        def fill(buf: torch.Tensor) -> None:
            buf.numpy()[:] = src

        return self._put(key, len(view), fill)

    def _put(self, key: str, nbytes: int, fill: Callable[[torch.Tensor], object]) -> StoreStatus:
        t0 = time.perf_counter()
        with self._lock:
            refused = self._refuse(key, nbytes)
        if refused is not None:
            return refused
        try:
            buf = self._alloc(nbytes)
            fill(buf)
        except (RuntimeError, MemoryError):  # pinned/host allocation failed
            with self._lock:
                self._counters.errors["no_space"] += 1
            return StoreStatus.NO_SPACE
        with self._lock:
            if key in self._index:
                return StoreStatus.EXISTS
            victims = self._index.plan_room(nbytes)
            if victims is None:
                self._counters.errors["no_space"] += 1
                return StoreStatus.NO_SPACE
            for victim, _ in victims:
                del self._bufs[victim]
            self._bufs[key] = buf
            self._index.add(key, nbytes)
            self._counters.note_store(nbytes, time.perf_counter() - t0)
        return StoreStatus.STORED

    # -- get / delete --------------------------------------------------------------------------

    def get_buffer(self, key: str) -> torch.Tensor | None:
        """The block's own buffer (no copy; pinned on CUDA, so the loader's
        `.to(dev, non_blocking=True)` overlaps), or None. Counts a hit/miss and touches the LRU like get(). The buffer is
        not reused after eviction (a new one is allocated per put), so holding it is safe."""
        t0 = time.perf_counter()
        self._wait()
        with self._lock:
            buf = self._bufs.get(key)
            if buf is None:
                self._counters.misses += 1
                return None
            self._index.touch(key)
            self._counters.note_hit(buf.numel(), time.perf_counter() - t0)
            return buf

    def get(self, key: str) -> LoadResult:
        t0 = time.perf_counter()
        self._wait()
        with self._lock:
            buf = self._bufs.get(key)
            if buf is None:
                self._counters.misses += 1
                return LoadResult(None, MissReason.ABSENT)
            self._index.touch(key)
        data = buf.numpy().tobytes()
        with self._lock:
            self._counters.note_hit(len(data), time.perf_counter() - t0)
        return LoadResult(data, None)

    def _wait(self) -> None:
        if self.delay_s > 0:
            time.sleep(self.delay_s)

    def delete(self, key: str) -> None:
        with self._lock:
            self._index.remove(key)
            self._bufs.pop(key, None)

    def refresh(self, full: bool = True) -> None:
        """Nothing to re-scan in memory (present so either store can be refreshed)."""

    def check_integrity(self) -> None:
        with self._lock:
            self._index.check()
            assert self._index.bytes_used <= self._index.capacity, "over capacity"
            assert set(self._bufs) == set(self._index.sizes), "buffers != index"
            for key, size in self._index.sizes.items():
                assert self._bufs[key].numel() == size, f"block {key}: buffer size != indexed"
