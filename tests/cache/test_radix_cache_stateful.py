"""RadixCache stateful property test: random interleavings of match / start / decode / finish /
chunk boundary / evict, with the test playing the scheduler against a plain model."""


from dataclasses import dataclass

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
