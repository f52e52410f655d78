"""TierLoads: waiting requests whose prefix is being read back from a tier into the pool.

While their blocks are read back on a worker thread, the requests wait in the queue.

Owns: the loads in flight (the pool pages each one holds, the tree lock on its pool match) and
starting one for the part of a hit the tiers' load-or-recompute choice keeps
(cache/tiers/load_choice.py: per tier and per request, never latched off). A request waits in the queue while its load runs, as it waits for
its grammar (the batch keeps stepping); when the load ends, the loaded tokens enter the tree
and the request is admitted as an ordinary pool hit, so admission, chunking and the page
invariant stay as they are. Pages are held by the load, not the request (the request holds
nothing while it waits). The scheduler owns this object, as it owns every other lock on the
tree. Does not know: files, payloads (cache/tiers/kv_tiers.py), batches.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass

from radixserve.cache.radix_cache import TreeNode
from radixserve.cache.tiers.block_loader import LoadDone
from radixserve.cache.tiers.kv_tiers import KVTiers
from radixserve.cache.tiers.tier_types import TierHit
from radixserve.sched.memory import MemoryManager
from radixserve.sched.req import Req


@dataclass
class PendingLoad:
    hit: TierHit
    node: TreeNode  # the pool match [0, hit.start), locked while the load runs
    prefix_slots: list[int]  # its slots
    slots: list[int]  # pages held for tokens [hit.start, hit.end)
    future: Future[LoadDone]
    keys: frozenset[str]


class TierLoads:
    def __init__(self, tiers: KVTiers, mem: MemoryManager) -> None:
        self.tiers = tiers
        self.mem = mem
        self.loads: dict[str, PendingLoad] = {}  # rid -> its load in flight
        self.orphans: list[PendingLoad] = []  # loads of aborted requests, still running
        # rid -> its pool match when the tiers were last probed for it: probed again only
        # when the pool lost some of it (evicted while the request waited).
        self._probed: dict[str, int] = {}
        # Told (rid, seconds, tokens loaded) when a request's load ends (engine timings).
        self.on_load: Callable[[str, float, int], None] | None = None

    # ---- the scheduler's calls -----------------------------------------------------------

    def ready(self, req: Req) -> bool:
        """False while req waits for a load (just started, or still running). True when it
        can be admitted: nothing to load, or its load finished (its tokens are in the tree)."""
        load = self.loads.get(req.rid)
        if load is None:
            pool_len = self.mem.cache.peek_prefix_len(self._query(req), req.cache_salt)
            if self._probed.get(req.rid, -1) >= pool_len:
                return True  # probed with this much in the pool: nothing more to load
            started = self._start(req, pool_len)
            if started is None:
                return False  # blocks another request is loading, or no room yet: wait
            if not started:
                self._probed[req.rid] = pool_len
            return not started
        if not load.future.done():
            return False
        del self.loads[req.rid]
        self._finish(req, load)
        self._probed[req.rid] = self.mem.cache.peek_prefix_len(self._query(req), req.cache_salt)
        return True

    def forget(self, req: Req) -> None:
        """req left the queue (admitted or aborted); a load still running becomes an orphan."""
        self._probed.pop(req.rid, None)
        load = self.loads.pop(req.rid, None)
        if load is not None:
            self.orphans.append(load)
            self.sync()

    def sync(self) -> None:
        """Tier bookkeeping each scheduling round: forget what the tiers no longer hold, and
        release finished orphan loads."""
        gone = self.tiers.sync()
        if gone:
            self.mem.cache.prune_tier_keys(gone)
        for load in [o for o in self.orphans if o.future.done()]:
            self.orphans.remove(load)
            self._release(load)

    def busy(self) -> bool:
        return bool(self.loads or self.orphans)

    def wait_any(self, timeout: float) -> None:
        futures = [ld.future for ld in (*self.loads.values(), *self.orphans)]
        if futures:
            wait(futures, timeout, FIRST_COMPLETED)

    def held_slots(self) -> list[int]:
        return [s for ld in (*self.loads.values(), *self.orphans) for s in ld.slots]

    def locked_nodes(self) -> list[TreeNode]:
        return [ld.node for ld in (*self.loads.values(), *self.orphans)]

    # ---- internals -----------------------------------------------------------------------

    @staticmethod
    def _query(req: Req) -> list[int]:
        return req.token_ids[: req.num_tokens - 1]  # the last token is computed (its logits)

    def _start(self, req: Req, pool_len: int) -> bool | None:
        """Start loading req's tier blocks past its pool match; False if there is nothing
        worth loading, None if it must wait (an earlier request is loading its first blocks,
        or the pool has no room for them now)."""
        cache, query = self.mem.cache, self._query(req)
        hit = self.tiers.probe(query, req.cache_salt, pool_len)
        hit = None if hit is None else self.tiers.choose(hit)
        if hit is None:
            return False
        if any(hit.keys[0] in ld.keys for ld in (*self.loads.values(), *self.orphans)):
            return None
        match = cache.match_prefix(query[: hit.start], req.cache_salt, priority=req.priority)
        assert match.cached_len == hit.start, (match.cached_len, hit.start)
        cache.lock(match.node)  # the allocation below may evict: never the prefix we extend
        page = self.mem.page
        pages = self.mem.alloc_pages(hit.num_tokens // page)
        if pages is None:
            cache.unlock(match.node)
            alloc = self.mem.allocator
            held = alloc.num_pages * page - alloc.num_free_slots - cache.total_size
            # Pages held by running requests or loads come back: try again then. With none
            # held (pins fill the pool), waiting would be forever: compute instead.
            return None if held > 0 else False
        slots = self.mem.allocator.pages_to_slots(pages)
        future = self.tiers.load(hit, slots)
        self.loads[req.rid] = PendingLoad(hit, match.node, list(match.slots), slots, future,
                                          frozenset(hit.keys))
        return True

    def _finish(self, req: Req, load: PendingLoad) -> None:
        """Put the loaded tokens into the tree (the blocks that loaded, in order); the rest
        of the pages go back."""
        done = load.future.result()
        self.tiers.record_load(done)
        if self.on_load is not None:
            self.on_load(req.rid, done.seconds, done.num_tokens)
        n = done.num_tokens
        if n:
            end = load.hit.start + n
            ins = self.mem.cache.insert(req.token_ids[:end], load.prefix_slots + load.slots[:n],
                                        req.cache_salt, req.priority)
            # Tokens another request put into the tree while we loaded: ours are duplicates.
            dup = max(0, ins.num_already_cached - load.hit.start)
            if dup:
                self.mem.free_slots(load.slots[:dup])
            load.slots = load.slots[n:]
        self._release(load)

    def _release(self, load: PendingLoad) -> None:
        """Unlock the load's pool match and free the pages it did not fill."""
        self.mem.cache.unlock(load.node)
        if load.slots:
            self.mem.free_slots(load.slots)
        load.slots = []
