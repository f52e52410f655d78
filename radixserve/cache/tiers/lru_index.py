"""The bounded LRU index, the counters, and the locked queries shared by every tier store.

Owns: key -> stored size in recency order, the keys held (evicted but not deletable yet:
still counted against the bound, no longer readable), the byte total, the list of keys
evicted since the caller last asked, and the statistics counters. Does not know: where the
bytes are (files or host memory), why a key is held (block_store.py). LruIndex and
TierCounters take no lock; IndexedStore, the stores' base, holds the one lock that guards them
and answers the queries that only read them.

Invariant (check): bytes_used == sum(sizes) + sum(held), and bytes_used <= capacity after
every plan_room that did not return None.
"""

from __future__ import annotations

import threading
from collections import Counter, OrderedDict

from radixserve.cache.radix_types import Tier
from radixserve.cache.tiers.block_keys import StoreStatus, TierStats


class LruIndex:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0, got {capacity_bytes}")
        self.capacity = capacity_bytes
        self.sizes: OrderedDict[str, int] = OrderedDict()  # oldest first
        self.held: dict[str, int] = {}  # evicted, bytes not freed yet: counted, not readable
        self.bytes_used = 0
        self.evicted: list[str] = []

    def __contains__(self, key: str) -> bool:
        return key in self.sizes

    def __len__(self) -> int:
        return len(self.sizes)

    def add(self, key: str, size: int) -> None:
        """Insert (or replace) `key` as the most recent entry (no longer held, if it was)."""
        self.remove(key)
        self.release(key)
        self.sizes[key] = size
        self.bytes_used += size

    def remove(self, key: str) -> bool:
        size = self.sizes.pop(key, None)
        if size is None:
            return False
        self.bytes_used -= size
        return True

    def hold(self, key: str, size: int) -> None:
        """Count `key`'s bytes although it left the index (they could not be freed yet)."""
        self.remove(key)
        if key not in self.held:
            self.held[key] = size
            self.bytes_used += size

    def release(self, key: str) -> bool:
        """A held key's bytes were freed (or are someone else's now): stop counting them."""
        size = self.held.pop(key, None)
        if size is None:
            return False
        self.bytes_used -= size
        return True

    def touch(self, key: str) -> None:
        if key in self.sizes:
            self.sizes.move_to_end(key)

    def plan_room(self, need: int, keep: str | None = None) -> list[tuple[str, int]] | None:
        """The oldest (key, size) entries to evict so that `need` more bytes fit; None if
        they never can (held bytes count: only indexed keys can be evicted).

        Removes them from the index and records them in `evicted`; the caller deletes their
        bytes (or holds them). `keep` (the key being written) is never chosen.
        """
        victims: list[tuple[str, int]] = []
        freed = 0
        for key, size in self.sizes.items():
            if self.bytes_used - freed + need <= self.capacity:
                break
            if key != keep:
                victims.append((key, size))
                freed += size
        if self.bytes_used - freed + need > self.capacity:
            return None  # nothing evicted: the block does not fit even in an empty store
        for key, _ in victims:
            self.remove(key)
        self.evicted.extend(key for key, _ in victims)
        return victims

    def take_evicted(self) -> list[str]:
        out, self.evicted = self.evicted, []
        return out

    def check(self) -> None:
        assert self.bytes_used == sum(self.sizes.values()) + sum(self.held.values()), (
            "bytes_used != sum of entry sizes")
        assert all(s >= 0 for s in self.sizes.values())
        assert not self.held.keys() & self.sizes.keys(), "a key both indexed and held"


class TierCounters:
    """Monotone totals since the store started (the metrics read them through stats())."""

    def __init__(self) -> None:
        self.stored_bytes = 0
        self.loaded_bytes = 0
        self.load_s = 0.0
        self.store_s = 0.0
        self.hits = 0
        self.misses = 0
        self.errors: Counter[str] = Counter()

    def note_hit(self, nbytes: int, seconds: float) -> None:
        self.hits += 1
        self.loaded_bytes += nbytes
        self.load_s += seconds

    def note_store(self, nbytes: int, seconds: float) -> None:
        self.stored_bytes += nbytes
        self.store_s += seconds

    def snapshot(self, tier: Tier, index: LruIndex) -> TierStats:
        return TierStats(
            tier=tier, num_blocks=len(index), bytes_used=index.bytes_used,
            capacity_bytes=index.capacity, stored_bytes_total=self.stored_bytes,
            loaded_bytes_total=self.loaded_bytes, load_seconds_total=self.load_s,
            store_seconds_total=self.store_s, hits=self.hits, misses=self.misses,
            errors=dict(self.errors),
        )


class IndexedStore:
    """The part of a tier store that is only its index: one lock, the LRU, the counters."""

    def __init__(self, capacity_bytes: int, tier: Tier) -> None:
        self.tier = tier
        self._lock = threading.Lock()  # guards _index and _counters (and a subclass's maps)
        self._index = LruIndex(capacity_bytes)
        self._counters = TierCounters()

    def _refuse(self, key: str, size: int) -> StoreStatus | None:
        """Why a put of `size` bytes under `key` ends before any work (counted); None: go on.
        The caller holds the lock."""
        if key in self._index:
            return StoreStatus.EXISTS
        if size > self._index.capacity:
            self._counters.errors["no_space"] += 1
            return StoreStatus.NO_SPACE
        return None

    def contains(self, key: str) -> bool:
        """Answered from memory without the lock (the step thread asks): one dict lookup is
        atomic, and a stale answer is a probe that later loads a miss, never a wrong block."""
        return key in self._index.sizes

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._index.sizes)

    def take_evicted(self) -> list[str]:
        """Keys that left the index by LRU eviction (or, in a BlockStore, because their file
        vanished) since the last call; not those removed by delete() or a failed get()."""
        with self._lock:
            return self._index.take_evicted()

    def stats(self) -> TierStats:
        with self._lock:
            return self._counters.snapshot(self.tier, self._index)
