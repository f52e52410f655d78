"""Eviction order: LRU vs scan-resistant SLRU, priority-aware, tenants over quota first."""

from __future__ import annotations

import pytest

from radixserve.cache.radix_cache import RadixCache


class Pool:
    """Slots handed out and taken back, like the allocator, for a cache of fixed capacity."""

    def __init__(self, cache: RadixCache, capacity: int) -> None:
        self.cache, self.capacity, self.next_slot, self.free = cache, capacity, 0, []

    def serve(self, tokens: list[int], salt: str = "", priority: int = 0) -> int:
        """One request: match (an admission), then insert the rest; returns the cached hit."""
        m = self.cache.match_prefix(tokens, salt, priority=priority)
        need = len(tokens) - m.cached_len
        short = need - (self.capacity - self.cache.total_size)
        if short > 0:
            self.cache.evict(short)
        slots = list(m.slots) + list(range(self.next_slot, self.next_slot + need))
        self.next_slot += need
        self.cache.insert(tokens, slots, salt, priority)
        assert self.cache.total_size <= self.capacity
        self.cache.check_integrity()
        return m.cached_len


def scan_trace_hit_rate(policy: str) -> float:
    """Each round: 3 hot 40-token system prompts, each asked by two users, then two one-off
    150-token prompts; the pool holds 300 tokens, so every round's one-offs evict."""
    cache = RadixCache(eviction_policy=policy)
    pool = Pool(cache, capacity=300)
    hot = [[1000 * (h + 1) + i for i in range(40)] for h in range(3)]
    hits = asked = 0
    for step in range(30):
        for h, prefix in enumerate(hot):
            for user in range(2):
                got = pool.serve(prefix + [5000 + 10 * step + 3 * h + user])
                if step > 0:
                    hits, asked = hits + min(got, 40), asked + 40
        for k in range(2):  # the scan: never seen again
            pool.serve([100_000 + 1000 * (2 * step + k) + i for i in range(150)])
    return hits / asked


def test_slru_keeps_hot_prefixes_through_a_scan_and_lru_does_not() -> None:
    slru, lru = scan_trace_hit_rate("slru"), scan_trace_hit_rate("lru")
    assert slru >= 0.9, slru
    assert lru <= 0.5, lru  # the first user of each round misses: the scan flushed it


def test_slru_evicts_protected_leaves_oldest_first_once_probation_is_empty() -> None:
    cache = RadixCache(eviction_policy="slru")
    pool = Pool(cache, capacity=1000)
    pool.serve([1, 2, 3])
    pool.serve([4, 5, 6])
    pool.serve([1, 2, 3, 7])  # hits [1, 2, 3]: protected
    pool.serve([4, 5, 6, 8])  # hits [4, 5, 6]: protected
    assert sorted(cache.evict(1)) == [6]  # probation first: the leaf [7] (never hit)
    assert sorted(cache.evict(1)) == [7]  # then [8]
    # Probation is empty: protected leaves go by age ([1, 2, 3] was hit first).
    assert sorted(cache.evict(1)) == [0, 1, 2]
    cache.check_integrity()


def test_leaves_of_less_important_requests_go_first() -> None:
    cache = RadixCache()
    pool = Pool(cache, capacity=1000)
    pool.serve([1, 2, 3], priority=5)  # a batch job
    pool.serve([4, 5, 6], priority=0)  # interactive, newer
    pool.serve([7, 8, 9], priority=5)  # newest, but unimportant
    assert sorted(cache.evict(1)) == [0, 1, 2]
    assert sorted(cache.evict(1)) == [6, 7, 8]
    assert sorted(cache.evict(1)) == [3, 4, 5]


def test_tenant_over_quota_is_evicted_first() -> None:
    cache = RadixCache(tenant_quota_tokens=10)
    pool = Pool(cache, capacity=1000)
    pool.serve(list(range(100, 104)), salt="quiet")  # oldest, within quota
    for i in range(4):
        pool.serve([200 + 10 * i + j for j in range(5)], salt="noisy")  # 20 tokens > 10
    assert cache.evictable_by_salt == {"quiet": 4, "noisy": 20}
    freed = cache.evict(10)  # LRU alone would take "quiet" first
    assert len(freed) == 10 and cache.evictable_by_salt == {"quiet": 4, "noisy": 10}
    cache.evict(1)  # noisy is within its quota now: plain LRU order again
    assert cache.evictable_by_salt == {"noisy": 10}
    cache.check_integrity()


@pytest.mark.parametrize("policy", ["lru", "slru"])
def test_unknown_policy_rejected_and_known_ones_accepted(policy: str) -> None:
    RadixCache(eviction_policy=policy).check_integrity()
    with pytest.raises(ValueError):
        RadixCache(eviction_policy="lfu")
