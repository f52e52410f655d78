"""RadixCache unit tests: match/insert/split, locks, LRU eviction, salts, pages, events."""

from __future__ import annotations

from array import array

import numpy as np
import pytest

from radixserve.cache.radix_cache import (
    CacheEvent,
    CacheEventKind,
    RadixCache,
)


def make(page_size: int = 1) -> tuple[RadixCache, list[CacheEvent]]:
    events: list[CacheEvent] = []
    return RadixCache(page_size=page_size, on_event=events.append), events


def test_insert_reports_already_cached_and_match_returns_slots() -> None:
    cache, _ = make()
    assert cache.match_prefix([1, 2, 3]).cached_len == 0
    first = cache.insert([1, 2, 3, 4], [10, 11, 12, 13])
    assert first.num_already_cached == 0 and list(first.node.key) == [1, 2, 3, 4]
    second = cache.insert([1, 2, 3, 4, 5, 6], [20, 21, 22, 23, 24, 25])
    assert second.num_already_cached == 4  # the caller frees its 20..23
    assert cache.total_size == 6 and cache.evictable_size == 6
    match = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert match.cached_len == 6 and match.slots == [10, 11, 12, 13, 24, 25]
    assert match.node is second.node
    again = cache.insert([1, 2, 3, 4, 5, 6], [30, 31, 32, 33, 34, 35])
    assert again.num_already_cached == 6 and again.node is second.node
    assert sorted(cache.all_slots()) == [10, 11, 12, 13, 24, 25]
    cache.check_integrity()


def test_match_splits_node_where_it_ends_inside() -> None:
    cache, events = make()
    cache.insert([1, 2, 3, 4, 5, 6], [0, 1, 2, 3, 4, 5])
    events.clear()
    match = cache.match_prefix([1, 2, 3, 9])
    assert match.cached_len == 3 and match.slots == [0, 1, 2]
    assert list(match.node.key) == [1, 2, 3] and len(match.node.children) == 1
    (lower,) = match.node.children.values()
    assert list(lower.key) == [4, 5, 6] and list(lower.value) == [3, 4, 5]
    assert cache.match_prefix([1, 2, 3]).node is match.node
    assert events == [] and cache.total_size == 6  # a split is not an event
    branch = cache.insert([1, 2, 7, 8], [6, 7, 8, 9])
    assert branch.num_already_cached == 2
    assert cache.match_prefix([1, 2, 7, 8]).slots == [0, 1, 8, 9]
    assert cache.total_size == 8
    cache.check_integrity()


def test_lock_protects_path_from_eviction() -> None:
    cache, _ = make()
    kept = cache.insert([1, 2, 3], [0, 1, 2]).node
    leaf = cache.insert([1, 2, 3, 4, 5], [0, 1, 2, 3, 4]).node
    cache.insert([7, 8], [5, 6])
    cache.lock(leaf)
    assert kept.lock_ref == 1 and leaf.lock_ref == 1
    assert cache.protected_size == 5 and cache.evictable_size == 2
    cache.lock(kept)
    assert kept.lock_ref == 2 and leaf.lock_ref == 1
    cache.check_integrity()
    assert sorted(cache.evict(100)) == [5, 6]
    assert cache.evict(100) == [] and cache.total_size == 5
    cache.unlock(leaf)
    assert cache.protected_size == 3 and cache.evict(100) == [3, 4]
    cache.unlock(kept)
    assert cache.evict(100) == [0, 1, 2] and cache.total_size == 0
    cache.check_integrity()
    with pytest.raises(AssertionError, match="unlock without"):
        cache.unlock(kept)


def test_split_of_a_locked_node_keeps_it_locked() -> None:
    cache, _ = make()
    leaf = cache.insert([1, 2, 3, 4], [0, 1, 2, 3]).node
    cache.lock(leaf)
    upper = cache.match_prefix([1, 2, 9]).node
    assert list(upper.key) == [1, 2] and upper.lock_ref == 1 and leaf.parent is upper
    assert cache.protected_size == 4 and cache.evict(10) == []
    cache.check_integrity()
    cache.unlock(leaf)
    assert cache.evictable_size == 4 and cache.evict(10) == [2, 3, 0, 1]
    cache.check_integrity()


def test_eviction_is_lru_and_parent_becomes_leaf() -> None:
    cache, _ = make()
    cache.insert([1, 1], [0, 1])
    cache.insert([2, 2], [2, 3])
    cache.insert([3, 3], [4, 5])
    cache.insert([3, 3, 4], [4, 5, 6])  # leaf [4] under [3, 3]
    cache.match_prefix([1, 1])  # now [2, 2] is the oldest
    assert cache.evict(1) == [2, 3]
    assert cache.evict(1) == [6]  # [3,3,4] was touched when inserted, before the match of [1,1]
    assert cache.evict(1) == [4, 5]  # its parent became an evictable leaf with the same age
    assert cache.evict(1) == [0, 1]
    assert cache.evict(1) == [] and cache.total_size == 0
    cache.check_integrity()


def test_evict_frees_enough_and_stops_within_one_leaf() -> None:
    cache, _ = make()
    for i in range(10):
        cache.insert([100 + i] * 5, list(range(5 * i, 5 * i + 5)))
    assert cache.evict(0) == []
    freed = cache.evict(7)
    assert len(freed) == 10  # two whole leaves of 5: >= 7 and less than 7 + one leaf
    assert freed == list(range(10))  # the two oldest
    assert len(cache.evict(1000)) == 40
    cache.check_integrity()


def test_salts_never_share() -> None:
    cache, events = make()
    cache.insert([1, 2, 3], [0, 1, 2], salt="tenant-a")
    assert cache.match_prefix([1, 2, 3]).cached_len == 0
    assert cache.match_prefix([1, 2, 3], salt="tenant-b").cached_len == 0
    assert cache.match_prefix([1, 2, 3], salt="tenant-a").slots == [0, 1, 2]
    assert cache.insert([1, 2, 3], [3, 4, 5]).num_already_cached == 0
    assert cache.match_prefix([1, 2, 3]).slots == [3, 4, 5]
    assert [e.salt for e in events] == ["tenant-a", ""]
    assert sorted(cache.evict(6)) == [0, 1, 2, 3, 4, 5]
    assert events[-1].kind == "removed" and {e.salt for e in events[-2:]} == {"", "tenant-a"}
    cache.check_integrity()


def test_page_size_four_matches_and_inserts_whole_pages() -> None:
    cache, events = make(page_size=4)
    tokens = list(range(10))
    slots = list(range(12, 16)) + list(range(28, 32)) + [4, 5]  # pages 3, 7, part of 1
    result = cache.insert(tokens, slots)
    assert result.num_already_cached == 0 and cache.total_size == 8  # the partial page stays out
    assert events[-1].token_ids == tuple(range(8))
    assert cache.match_prefix(tokens).slots == slots[:8]
    assert cache.match_prefix(tokens[:3]).cached_len == 0
    diverged = tokens[:6] + [99, 99]
    match = cache.match_prefix(diverged)
    assert match.cached_len == 4 and match.slots == slots[:4]  # mismatch inside page 2
    assert list(match.node.key) == [0, 1, 2, 3]
    again = cache.insert(diverged, list(range(0, 4)) + list(range(8, 12)))
    assert again.num_already_cached == 4 and cache.total_size == 12
    cache.check_integrity()
    with pytest.raises(AssertionError):
        cache.insert(list(range(50, 54)), [1, 2, 3, 4])  # not page aligned


def test_events_carry_the_full_path() -> None:
    cache, events = make()
    cache.insert([1, 2, 3], [0, 1, 2], salt="s")
    cache.insert([1, 2, 3, 4, 5], [0, 1, 2, 3, 4], salt="s")
    assert events == [
        CacheEvent(CacheEventKind.STORED, (1, 2, 3), 0, "s"),
        CacheEvent(CacheEventKind.STORED, (1, 2, 3, 4, 5), 3, "s"),
    ]
    assert events[0].kind == "stored"
    events.clear()
    cache.evict(1)
    assert events == [CacheEvent(CacheEventKind.REMOVED, (1, 2, 3, 4, 5), 3, "s")]
    events.clear()
    assert cache.reset() == [0, 1, 2]
    assert events == [CacheEvent(CacheEventKind.CLEARED, (), 0, "")]


def test_reset_returns_every_slot_and_refuses_locked_nodes() -> None:
    cache, _ = make()
    node = cache.insert([1, 2], [5, 6]).node
    cache.insert([3], [7], salt="x")
    cache.lock(node)
    with pytest.raises(AssertionError):
        cache.reset()
    cache.unlock(node)
    assert sorted(cache.reset()) == [5, 6, 7]
    assert cache.total_size == 0 and cache.match_prefix([1, 2]).cached_len == 0
    cache.check_integrity()


def test_disabled_cache_takes_nothing() -> None:
    cache = RadixCache(page_size=2, disabled=True)
    result = cache.insert([1, 2, 3, 4, 5], [0, 1, 2, 3, 4])
    assert result.num_already_cached == 4 and result.node is cache.root  # caller frees all
    match = cache.match_prefix([1, 2, 3, 4])
    assert match.node is cache.root and match.cached_len == 0 and match.slots == []
    cache.lock(match.node)
    cache.unlock(match.node)
    assert cache.total_size == 0 and cache.evict(10) == [] and cache.reset() == []
    cache.check_integrity()


def test_inputs_as_array_and_numpy_and_bad_lengths() -> None:
    cache, _ = make()
    cache.insert(np.array([5, 6, 7], dtype=np.int64), array("i", [0, 1, 2]))
    assert cache.match_prefix(array("i", [5, 6, 7, 8])).slots == [0, 1, 2]
    assert cache.match_prefix(np.array([5, 6], dtype=np.int32)).slots == [0, 1]
    with pytest.raises(ValueError):
        cache.insert([1, 2], [0])
    with pytest.raises(ValueError):
        RadixCache(page_size=0)


def test_heap_stays_bounded_under_lock_churn() -> None:
    cache, _ = make()
    node = cache.insert([1, 2, 3], [0, 1, 2]).node
    for _ in range(1000):
        cache.lock(node)
        cache.unlock(node)
        cache.match_prefix([1, 2, 3])
    assert cache._queue._num_entries <= 2 * len(cache._queue.leaves) + 65
    assert cache.evict(1) == [0, 1, 2]
    cache.check_integrity()


def test_check_integrity_catches_corruption() -> None:
    cache, _ = make()
    leaf = cache.insert([1, 2, 3], [0, 1, 2]).node
    cache.insert([1, 4], [3, 4])
    cache.check_integrity()
    leaf.lock_ref = 1  # a lock the counters never saw
    with pytest.raises(AssertionError):
        cache.check_integrity()
    leaf.lock_ref = 0
    leaf.value[0] = 0  # after the split leaf is [2, 3]; slot 0 is its parent's
    with pytest.raises(AssertionError, match="slot twice"):
        cache.check_integrity()


@pytest.mark.parametrize("page_size", [1, 2])
def test_peek_changes_nothing_and_agrees_with_match(page_size: int) -> None:
    """Ordering the waiting queue peeks: no split, no LRU touch; admission matches once."""
    cache, events = make(page_size)
    cache.insert([1, 2, 3, 4, 5, 6], list(range(10, 16)))
    cache.insert([7, 8, 9, 10], list(range(20, 24)))
    shape = sorted((tuple(n.key), n.last_access) for n in cache._iter_nodes())
    assert cache.peek_prefix_len([1, 2, 3, 4, 9, 9]) == 4  # ends inside [1..6]: no split
    assert cache.peek_prefix_len([1, 2, 3, 4, 5, 6, 7, 8]) == 6
    assert cache.peek_prefix_len([1, 2, 3]) == (3 if page_size == 1 else 2)
    assert cache.peek_prefix_len([9]) == 0 and cache.peek_prefix_len([1], salt="other") == 0
    assert sorted((tuple(n.key), n.last_access) for n in cache._iter_nodes()) == shape
    # LRU untouched: [1..6] is still the older leaf, evicted first.
    assert sorted(cache.evict(6)) == list(range(10, 16))
    assert cache.match_prefix([7, 8, 9, 10, 11]).cached_len == 4
    cache.check_integrity()
