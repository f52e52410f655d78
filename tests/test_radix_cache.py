"""RadixCache unit tests: match/insert/split, locks, LRU eviction, salts, pages, events."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from radixserve.cache.page_allocator import PageAllocator
from radixserve.cache.radix_cache import (
    CacheEvent,
    CacheEventKind,
    MatchResult,
    RadixCache,
    TreeNode,
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
    assert len(cache._heap) <= 2 * len(cache._evictable_leaves) + 65
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


# -- stateful property test: the test plays the scheduler against a plain model -----------

NUM_PAGES = 24
# Shared bases cut at random points plus a random tail over a 3-token alphabet: prefixes
# collide often, and matches end inside nodes (splits).
BASES = ((0, 1, 2, 0, 1, 2, 0, 1), (0, 1, 2, 2, 2, 1, 1, 0), (1, 1, 1, 1, 0, 0, 0, 0))
TOKENS = st.builds(
    lambda base, cut, tail: list(base[:cut]) + tail,
    st.sampled_from(BASES), st.integers(0, 8), st.lists(st.integers(0, 2), max_size=6),
)
SALTS = st.sampled_from(["", "tenant"])
Key = tuple[str, tuple[int, ...]]  # (salt, a whole-page prefix)


@dataclass
class Running:
    salt: str
    token_ids: list[int]
    slots: list[int]  # slots[:prefix_len] belong to the tree, the rest to `pages`
    prefix_len: int
    node: TreeNode  # locked
    pages: list[int]  # held by this request, in order


class CacheMachine(RuleBasedStateMachine):
    """Model: every cached whole-page prefix -> the slots of its last page, plus the op
    counter of its last touch. The tree must agree with it after every step."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[CacheEvent] = []
        self.model: dict[Key, tuple[int, ...]] = {}
        self.access: dict[Key, int] = {}
        self.from_events: set[Key] = set()
        self.running: list[Running] = []
        self.clock = 0

    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def setup(self, page_size: int) -> None:
        self.ps = page_size
        self.alloc = PageAllocator(NUM_PAGES, page_size)
        self.cache = RadixCache(page_size, on_event=self.events.append)

    # -- model helpers

    def longest(self, salt: str, tokens: list[int]) -> int:
        k = 0
        while k + self.ps <= len(tokens) and (salt, tuple(tokens[:k + self.ps])) in self.model:
            k += self.ps
        return k

    def touch(self, salt: str, tokens: list[int], length: int) -> None:
        self.clock += 1
        for k in range(self.ps, length + 1, self.ps):
            self.access[(salt, tuple(tokens[:k]))] = self.clock

    def checked_match(self, salt: str, tokens: list[int]) -> MatchResult:
        result = self.cache.match_prefix(tokens, salt)
        k = self.longest(salt, tokens)
        assert result.cached_len == k
        pages = [self.model[(salt, tuple(tokens[:j]))] for j in range(self.ps, k + 1, self.ps)]
        assert result.slots == [s for page in pages for s in page]
        self.touch(salt, tokens, k)
        return result

    def locked_keys(self) -> set[Key]:
        return {(r.salt, tuple(r.token_ids[:k]))
                for r in self.running for k in range(self.ps, r.prefix_len + 1, self.ps)}

    def drain_events(self) -> list[CacheEvent]:
        events, self.events[:] = list(self.events), []
        for e in events:
            keys = {(e.salt, e.token_ids[:k])
                    for k in range(e.prefix_len + self.ps, len(e.token_ids) + 1, self.ps)}
            if e.kind == CacheEventKind.STORED:
                assert not keys & self.from_events
                self.from_events |= keys
            else:
                assert e.kind == CacheEventKind.REMOVED and keys <= self.from_events
                self.from_events -= keys
        return events

    def evict(self, num_tokens: int) -> None:
        self.drain_events()
        evictable_before = self.cache.evictable_size
        freed = self.cache.evict(num_tokens)
        removed_events = self.drain_events()
        assert len(freed) >= min(num_tokens, evictable_before)
        if len(freed) > num_tokens:  # the overshoot is less than the last leaf evicted
            last = removed_events[-1]
            assert len(freed) - (len(last.token_ids) - last.prefix_len) < num_tokens
        freed_set = set(freed)
        gone = {key for key, slots in self.model.items() if slots[0] in freed_set}
        assert sum(len(self.model[key]) for key in gone) == len(freed)
        assert not gone & self.locked_keys()
        for key in gone:
            del self.model[key]
        parents = {(salt, p[:-self.ps]) for salt, p in self.model}
        leaves = set(self.model) - parents - self.locked_keys()
        if gone and leaves:  # LRU: nothing evicted was touched after a surviving leaf
            assert max(self.access[k] for k in gone) <= min(self.access[k] for k in leaves)
        self.alloc.free(self.alloc.slots_to_pages(freed))

    def alloc_pages(self, num_pages: int) -> list[int] | None:
        if num_pages > self.alloc.num_free_pages:
            self.evict((num_pages - self.alloc.num_free_pages) * self.ps)
        return self.alloc.alloc(num_pages)

    def cache_request(self, req: Running, keep_running: bool) -> None:
        """Cache req's tokens; then finish it, or move its lock to the new node (chunking)."""
        aligned = len(req.token_ids) // self.ps * self.ps
        expected_cached = self.longest(req.salt, req.token_ids)
        result = self.cache.insert(req.token_ids, req.slots, req.salt)
        num_cached = result.num_already_cached
        assert num_cached == min(expected_cached, aligned) and num_cached >= req.prefix_len
        for k in range(num_cached + self.ps, aligned + 1, self.ps):
            self.model[(req.salt, tuple(req.token_ids[:k]))] = tuple(req.slots[k - self.ps:k])
        self.touch(req.salt, req.token_ids, aligned)
        first_kept = (aligned - req.prefix_len) // self.ps  # own pages from here hold the tail
        first_taken = (num_cached - req.prefix_len) // self.ps
        self.alloc.free(req.pages[:first_taken])  # duplicates of what the tree had
        if not keep_running:
            self.alloc.free(req.pages[first_kept:])
            self.cache.unlock(req.node)
            self.running.remove(req)
            return
        match = self.checked_match(req.salt, req.token_ids[:aligned])
        assert match.slots[num_cached:] == req.slots[num_cached:aligned]
        self.cache.lock(match.node)
        self.cache.unlock(req.node)
        req.slots = match.slots + req.slots[aligned:]
        req.prefix_len, req.node, req.pages = aligned, match.node, req.pages[first_kept:]

    # -- rules

    @rule(tokens=TOKENS, salt=SALTS)
    def match(self, tokens: list[int], salt: str) -> None:
        self.checked_match(salt, tokens)

    @rule(tokens=TOKENS, salt=SALTS)
    def start(self, tokens: list[int], salt: str) -> None:
        match = self.checked_match(salt, tokens)
        self.cache.lock(match.node)
        num_new = len(tokens) - match.cached_len
        pages = self.alloc_pages(-(-num_new // self.ps))
        if pages is None:
            self.cache.unlock(match.node)
            return
        own = self.alloc.pages_to_slots(pages)[:num_new]
        self.running.append(
            Running(salt, list(tokens), match.slots + own, match.cached_len, match.node, pages))

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=st.integers(0, 2))
    def decode(self, data: st.DataObject, token: int) -> None:
        req = data.draw(st.sampled_from(self.running))
        num_own = len(req.token_ids) - req.prefix_len
        if num_own == len(req.pages) * self.ps:
            pages = self.alloc_pages(1)
            if pages is None:
                return
            req.pages += pages
        req.token_ids.append(token)
        req.slots.append(self.alloc.pages_to_slots(req.pages)[num_own])

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self.cache_request(data.draw(st.sampled_from(self.running)), keep_running=False)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def chunk_boundary(self, data: st.DataObject) -> None:
        self.cache_request(data.draw(st.sampled_from(self.running)), keep_running=True)

    @rule(num_tokens=st.integers(0, 3 * NUM_PAGES))
    def evict_some(self, num_tokens: int) -> None:
        self.evict(num_tokens)

    @invariant()
    def books_balance(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.drain_events()
        self.cache.check_integrity()
        self.alloc.check_integrity()
        held = sum(len(r.pages) for r in self.running)
        assert self.alloc.num_free_pages + self.cache.total_size // self.ps + held == NUM_PAGES
        assert self.cache.total_size == len(self.model) * self.ps
        assert self.cache.protected_size == len(self.locked_keys()) * self.ps
        assert sorted(self.cache.all_slots()) == sorted(s for v in self.model.values() for s in v)
        assert self.from_events == set(self.model)


TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
