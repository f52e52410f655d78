"""MemoryManager: the scheduler's page bookkeeping between the allocator, the tree and requests.

Owns: allocation with eviction, matching and locking on admission, moving computed pages
into the tree (at chunk boundaries and on release), which rows of the slot table are free
(row numbers only: the model runner writes the table's contents from each batch), and the
decode-token reservation ratio. It writes a Req's page fields (slots, cache_node, table_row,
num_computed_tokens, num_tree_tokens, num_table_slots) on the scheduler's behalf (it is the
scheduler's helper, not a peer); never a status or a queue. Does not know: batches,
phases, sampling, tensors.

Region diagram of one request's slots (P = page size, k = num_computed_tokens rounded down
to P):

    [0, num_tree_tokens)   tree pages, locked via req.cache_node
    [num_tree_tokens, k)   computed whole pages not yet in the tree -> inserted on progress
    [k, len(slots))        the partial page and pages allocated ahead: held by the request
"""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.cache.page_allocator import PageAllocator
from radixserve.cache.radix_cache import RadixCache
from radixserve.sched.req import Req


@dataclass(frozen=True)
class KVUsage:
    """Where the pool's tokens are: free + cached + held == total (cached includes evictable)."""

    total: int
    free: int
    cached: int
    evictable: int
    held: int


INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
RATIO_DECAY_STEPS = 600


class MemoryManager:
    def __init__(self, allocator: PageAllocator, cache: RadixCache, num_rows: int,
                 disable_cache: bool) -> None:
        self.allocator = allocator
        self.cache = cache
        self._free_rows = list(range(num_rows - 1, -1, -1))  # pop() gives row 0 first
        self.disabled = disable_cache
        self.page = allocator.page_size
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO

    # ---- allocation ----------------------------------------------------------------------

    def alloc_pages(self, num_pages: int) -> list[int] | None:
        """Pages for a tier load (held by the load until its tokens enter the tree)."""
        return self._alloc_pages(num_pages)

    def free_slots(self, slots: list[int]) -> None:
        self.allocator.free(self.allocator.slots_to_pages(slots))

    def _alloc_pages(self, num_pages: int) -> list[int] | None:
        pages = self.allocator.alloc(num_pages)
        if pages is None:
            short = num_pages - self.allocator.num_free_pages
            freed = self.cache.evict(short * self.page)
            if freed:
                self.allocator.free(self.allocator.slots_to_pages(freed))
            pages = self.allocator.alloc(num_pages)
        return pages

    def ensure_slots(self, req: Req, upto: int) -> bool:
        """Make req.slots cover positions [0, upto); False (nothing changed) if out of memory."""
        missing = upto - len(req.slots)
        if missing <= 0:
            return True
        pages = self._alloc_pages(-(-missing // self.page))
        if pages is None:
            return False
        req.slots.extend(self.allocator.pages_to_slots(pages))
        return True

    def ensure_next_slots(self, reqs: list[Req]) -> bool:
        """Every request's next slot (a decode step), in one allocation (with eviction) for all
        that need a page. False, nothing changed, when the pool cannot give them all."""
        needy = [r for r in reqs if len(r.slots) <= r.num_computed_tokens]
        if not needy:
            return True
        pages = self._alloc_pages(len(needy))
        if pages is None:
            return False
        size = self.page
        if size == 1:
            for r, page in zip(needy, pages, strict=True):
                r.slots.append(page)
        else:
            for r, page in zip(needy, pages, strict=True):
                r.slots.extend(range(page * size, page * size + size))
        return True

    def trim_slots(self, req: Req, upto: int) -> None:
        """Free the request's slots past position `upto` (rounded up to a page): drafts the
        target model rejected. Only held slots past req.num_computed_tokens can go."""
        keep = -(-upto // self.page) * self.page
        assert keep >= req.num_computed_tokens >= req.num_tree_tokens
        extra = req.slots[keep:]
        if extra:
            del req.slots[keep:]
            self.allocator.free(self.allocator.slots_to_pages(extra))

    def available_tokens(self) -> int:
        return self.allocator.num_free_slots + self.cache.evictable_size

    # ---- admission -----------------------------------------------------------------------

    def peek_match(self, req: Req) -> int:
        """Cached prefix length for ordering the queue; changes nothing in the tree."""
        if self.disabled:
            return 0
        return self.cache.peek_prefix_len(req.token_ids[: req.num_tokens - 1], req.cache_salt)

    def admit(self, req: Req, budget: int, chunk_cap: int | None, reserve: int,
              force: bool) -> int:
        """Match, lock, take a table row and slots for the first chunk; return its length (0:
        not admitted, nothing changed). `force` admits despite the reservation (progress)."""
        if not self._free_rows:
            return 0
        req.table_row, req.num_table_slots = self._free_rows.pop(), 0
        if not self.disabled:
            # Leave at least one token to compute: its logits give the next token.
            match = self.cache.match_prefix(req.token_ids[: req.num_tokens - 1], req.cache_salt,
                                            priority=req.priority)
            self.cache.lock(match.node)
            req.cache_node, req.slots = match.node, list(match.slots)
            req.num_tree_tokens = req.num_computed_tokens = match.cached_len
        n = req.next_chunk_len(budget, chunk_cap)
        # The whole remaining prompt must fit, not only its first chunk, or chunked prompts
        # admitted together can fill the pool and wait on each other forever.
        fits = self.available_tokens() - req.num_uncomputed_tokens >= (0 if force else reserve)
        if not fits or not self.ensure_slots(req, req.num_computed_tokens + n):
            self.release(req)
            return 0
        return n

    # ---- moving pages into the tree ------------------------------------------------------

    def cache_progress(self, req: Req) -> None:
        """Insert the request's computed whole pages into the tree; adopt the tree's copies of
        pages another request inserted first (freeing ours), and move the lock forward."""
        if self.disabled:
            return
        k = req.num_computed_tokens // self.page * self.page
        tree = req.num_tree_tokens
        if k <= tree:
            return
        ins = self.cache.insert(req.token_ids[:k], req.slots[:k], req.cache_salt, req.priority)
        dup = req.slots[tree : ins.num_already_cached]
        match = self.cache.match_prefix(req.token_ids[:k], req.cache_salt)
        assert match.cached_len == k, (match.cached_len, k)
        self.cache.lock(match.node)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        if dup:
            req.slots[tree : ins.num_already_cached] = match.slots[tree : ins.num_already_cached]
            self.allocator.free(self.allocator.slots_to_pages(dup))
            # The runner's table row still names the freed pages: rewrite from here.
            req.num_table_slots = min(req.num_table_slots, tree)
        req.cache_node, req.num_tree_tokens = match.node, k

    def release(self, req: Req) -> None:
        """Give back everything a request holds (finish, abort, retract): computed pages go to
        the tree, the rest to the allocator; unlock; free the table row."""
        self.cache_progress(req)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
        own = req.slots[req.num_tree_tokens :]
        if own:
            self.allocator.free(self.allocator.slots_to_pages(own))
        if req.table_row >= 0:
            assert req.table_row not in self._free_rows, f"row {req.table_row} released twice"
            self._free_rows.append(req.table_row)
        req.slots, req.cache_node, req.table_row = [], None, -1
        req.num_tree_tokens = req.num_computed_tokens = req.num_table_slots = 0

    # ---- the decode reservation ----------------------------------------------------------

    def decay_ratio(self) -> None:
        step = (INIT_NEW_TOKEN_RATIO - MIN_NEW_TOKEN_RATIO) / RATIO_DECAY_STEPS
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO, self.new_token_ratio - step)

    def on_retract(self, running: list[Req]) -> None:
        # Observed progress says how much of max_tokens requests really use; start from it.
        done = sum(r.num_output_tokens for r in running)
        asked = sum(r.max_new_tokens for r in running) or 1
        self.new_token_ratio = min(1.0, max(INIT_NEW_TOKEN_RATIO, done / asked + 0.1))

    # ---- accounting ----------------------------------------------------------------------

    def future_tokens(self, req: Req) -> int:
        """The decode tokens req is expected to still need (the decaying estimate)."""
        return int(min(req.remain_tokens, 4096) * self.new_token_ratio)

    def reserved_tokens(self, live: list[Req], batch: list[Req], lens: list[int]) -> int:
        """Tokens promised to admitted requests (`live`, and `batch`: this step's chunks of
        `lens` tokens): the rest of their prompts beyond this step's chunk (already
        allocated) and an estimate of their future decode tokens."""
        this_step = {id(r): n for r, n in zip(batch, lens, strict=True)}
        in_live = {id(r) for r in live}
        promised = live + [r for r in batch if id(r) not in in_live]
        return sum(r.num_uncomputed_tokens - this_step.get(id(r), 0) + self.future_tokens(r)
                   for r in promised)

    def held_tokens(self, live: list[Req]) -> int:
        return sum(len(r.slots) - r.num_tree_tokens for r in live)

    def usage(self, live: list[Req]) -> KVUsage:
        return KVUsage(total=self.allocator.num_pages * self.page,
                       free=self.allocator.num_free_slots, cached=self.cache.total_size,
                       evictable=self.cache.evictable_size, held=self.held_tokens(live))

    def flush_cache(self) -> None:
        """Drop every cached prefix that is not locked. No request may be live (the caller
        checks); pins (locks the scheduler holds) survive."""
        cache = self.cache
        # With tiers, eviction demotes: a flushed pool stays loadable from the tiers.
        if cache.protected_size == 0 and not cache.tiered:
            freed = cache.reset()
        else:
            freed = cache.evict(cache.evictable_size)
        if freed:
            self.allocator.free(self.allocator.slots_to_pages(freed))

    def check_integrity(self, live: list[Req], pinned_tokens: int = 0,
                        loading: list[int] | None = None) -> None:
        """free + cached + held == total, no slot owned twice, locks match live requests and
        pins (`pinned_tokens`: the tokens on the pinned paths). `loading`: the slots tier
        loads hold (held too; None: no load in flight, so no lock may be left over)."""
        self.allocator.check_integrity()
        self.cache.check_integrity()
        loading = loading or []
        held = self.held_tokens(live) + len(loading)
        total = self.allocator.num_pages * self.page
        free, cached = self.allocator.num_free_slots, self.cache.total_size
        assert free + cached + held == total, (free, cached, held, total)
        rows = [r.table_row for r in live]
        assert len(set(rows)) == len(rows) and not set(rows) & set(self._free_rows), rows
        assert all(r.num_table_slots <= r.num_computed_tokens for r in live)
        owned = [s for r in live for s in r.slots[r.num_tree_tokens :]] + loading
        assert len(owned) == len(set(owned)), "a slot is held by two requests"
        assert not set(owned) & set(self.cache.all_slots()), "a held slot is also in the tree"
        if not live and not loading:
            assert self.cache.protected_size == pinned_tokens, "locks left with no live request"
