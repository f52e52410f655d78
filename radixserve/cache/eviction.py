"""Which unlocked leaf the radix cache evicts next: (segmented) LRU, by priority and tenant.

Owns: the set of evictable leaves and the lazy heaps that order them. Does not know: the
tree's shape, locks or sizes (radix_cache.py tells it when a leaf becomes or stops being
evictable), requests, pages.

Order of eviction, smallest key first: (tier, -priority, last_access).
  tier      LRU: always 0. SLRU: 0 = probation (no request matched it since it was inserted),
            1 = protected (matched at least once). One-off prompts, however long, only ever
            displace other one-offs while probation leaves remain: a scan cannot flush the
            prefixes that are really shared. When probation is empty, protected leaves go
            oldest first, so a prefix that stopped being used still ages out.
  priority  the priority of the last request that matched the node (lower = more important,
            as vLLM): leaves last used by less important requests go first.
Per salt (tenant) there is one heap per tier; pop() takes the best head over the salts it is
asked about, so eviction can be limited to tenants over their quota. Entries are lazy: a
head whose node is no longer an evictable leaf is dropped, one whose key or tier changed is
pushed again with its current key.
"""

from __future__ import annotations

import enum
import heapq
import itertools
from collections.abc import Iterable

from radixserve.cache.radix_types import TreeNode

Key = tuple[int, int, int]  # (tier, -priority, last_access)
Entry = tuple[Key, int, TreeNode]  # the int breaks ties, so nodes are never compared


class EvictionPolicy(str, enum.Enum):
    LRU = "lru"
    SLRU = "slru"


class EvictionQueue:
    def __init__(self, policy: EvictionPolicy = EvictionPolicy.LRU) -> None:
        self.policy = policy
        self.leaves: set[TreeNode] = set()
        self._heaps: dict[str, tuple[list[Entry], list[Entry]]] = {}  # salt -> (tier 0, 1)
        self._seq = itertools.count()
        self._num_entries = 0

    def key(self, node: TreeNode) -> Key:
        tier = 1 if self.policy is EvictionPolicy.SLRU and node.hits > 0 else 0
        return (tier, -node.priority, node.last_access)

    def add(self, node: TreeNode) -> None:
        """node is now an unlocked leaf."""
        self.leaves.add(node)
        self._push(node)

    def discard(self, node: TreeNode) -> None:
        """node is no longer an evictable leaf (locked, grew a child, or removed)."""
        self.leaves.discard(node)

    def clear(self) -> None:
        self.leaves.clear()
        self._heaps.clear()
        self._num_entries = 0

    def pop(self, salts: Iterable[str] | None = None) -> TreeNode | None:
        """Remove and return the next leaf to evict among `salts` (None: every salt)."""
        best: tuple[Key, list[Entry]] | None = None
        for salt in list(self._heaps) if salts is None else salts:
            heaps = self._heaps.get(salt)
            if heaps is None:
                continue
            for heap in heaps:
                self._settle_head(heap)
                if heap and (best is None or heap[0][0] < best[0]):
                    best = (heap[0][0], heap)
            if not heaps[0] and not heaps[1]:
                del self._heaps[salt]
        if best is None:
            return None
        _, _, node = heapq.heappop(best[1])
        self._num_entries -= 1
        self.leaves.remove(node)
        return node

    def queued(self) -> set[TreeNode]:
        """Nodes with an entry no later than their current key (for checks): a stale entry
        surfaces early and is requeued, never late."""
        out: set[TreeNode] = set()
        for heaps in self._heaps.values():
            for heap in heaps:
                out.update(node for key, _, node in heap if key <= self.key(node))
        return out

    def _settle_head(self, heap: list[Entry]) -> None:
        while heap:
            key, _, node = heap[0]
            if node not in self.leaves:
                heapq.heappop(heap)  # evicted, locked or grew children since it was pushed
                self._num_entries -= 1
            elif key != self.key(node):
                heapq.heappop(heap)  # touched or promoted since: requeue at its current key
                self._num_entries -= 1
                self._push(node, rebuild=False)  # pop() holds references to the heaps
            else:
                return

    def _push(self, node: TreeNode, rebuild: bool = True) -> None:
        key = self.key(node)
        heaps = self._heaps.setdefault(node.salt, ([], []))
        heapq.heappush(heaps[key[0]], (key, next(self._seq), node))
        self._num_entries += 1
        if rebuild and self._num_entries > 2 * len(self.leaves) + 64:
            self._rebuild()  # stale entries pile up under lock/unlock churn; O(leaves), amortized

    def _rebuild(self) -> None:
        self._heaps.clear()
        self._num_entries = 0
        for node in self.leaves:
            key = self.key(node)
            self._heaps.setdefault(node.salt, ([], []))[key[0]].append(
                (key, next(self._seq), node))
            self._num_entries += 1
        for heaps in self._heaps.values():
            for heap in heaps:
                heapq.heapify(heap)
