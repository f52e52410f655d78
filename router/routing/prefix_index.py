"""The approximate prefix index: which worker was last sent which chained block hashes.

Owns: a map from chained block hash to the workers believed to hold that block, under ONE
memory budget for all workers together (`max_entries` (block, worker) pairs), forgetting the
least recently used pair first. Does not know: how hashes are computed (route_key.py), HTTP,
what replicas really hold (kv_index.py follows that in precise mode).

Because block i's hash covers blocks 0..i-1, "worker w holds block i" implies it was sent the
whole prefix up to block i, so a match is the longest run of consecutive blocks from block 0.
`record` touches a request's blocks deepest-first, which makes the deepest blocks the least
recent: the LRU forgets the tails of prefixes before their heads, as a radix cache does.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence


class ApproxPrefixIndex:
    def __init__(self, max_entries: int) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._lru: OrderedDict[tuple[int, str], None] = OrderedDict()  # oldest first
        self._by_hash: dict[int, set[str]] = {}
        self._by_worker: dict[str, set[int]] = {}

    def __len__(self) -> int:
        return len(self._lru)

    def num_entries(self, worker: str) -> int:
        return len(self._by_worker.get(worker, ()))

    def match(self, hashes: Sequence[int], workers: Sequence[str]) -> dict[str, int]:
        """Blocks matched from block 0 for each of `workers` (0 if none). Reads, never touches."""
        matched = dict.fromkeys(workers, 0)
        alive = set(workers)
        for depth, h in enumerate(hashes):
            alive &= self._by_hash.get(h, set())
            if not alive:
                break
            for w in alive:
                matched[w] = depth + 1
        return matched

    def record(self, hashes: Sequence[int], worker: str) -> None:
        """Remember that `worker` now holds every block of `hashes`; evict LRU past the budget."""
        for h in reversed(hashes):
            key = (h, worker)
            if key in self._lru:
                self._lru.move_to_end(key)
                continue
            self._lru[key] = None
            self._by_hash.setdefault(h, set()).add(worker)
            self._by_worker.setdefault(worker, set()).add(h)
        while len(self._lru) > self.max_entries:
            (h, w), _ = self._lru.popitem(last=False)
            self._forget(h, w)

    def drop_worker(self, worker: str) -> int:
        """Forget everything about `worker` (it was removed); returns the entries dropped."""
        hashes = self._by_worker.pop(worker, set())
        for h in hashes:
            del self._lru[(h, worker)]
            holders = self._by_hash[h]
            holders.discard(worker)
            if not holders:
                del self._by_hash[h]
        return len(hashes)

    def _forget(self, h: int, worker: str) -> None:
        holders = self._by_hash[h]
        holders.discard(worker)
        if not holders:
            del self._by_hash[h]
        blocks = self._by_worker[worker]
        blocks.discard(h)
        if not blocks:
            del self._by_worker[worker]

    def _pairs(self) -> Iterator[tuple[int, str]]:
        for h, holders in self._by_hash.items():
            for w in holders:
                yield h, w

    def check_integrity(self) -> None:
        """The three views hold the same pairs, no empty sets linger, and the budget holds."""
        assert len(self._lru) <= self.max_entries, (len(self._lru), self.max_entries)
        by_hash = set(self._pairs())
        by_worker = {(h, w) for w, hs in self._by_worker.items() for h in hs}
        assert by_hash == by_worker == set(self._lru), "prefix index views disagree"
        assert all(self._by_hash.values()) and all(self._by_worker.values()), "empty set kept"
