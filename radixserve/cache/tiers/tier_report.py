"""TierReport: what the tiers tell the engine, and their counters.

Finished writes and evictions (the keys the tree must forget), the block events, the
counters, and the step-wait histogram.

Owns: per-tier hit tokens, the errors the tiers (not the stores) saw, the load totals, the
kv_events of tier blocks, and the histogram of the seconds each engine step spent on tier work
(radixserve:kv_offload_step_wait_seconds). Does not know: the tree, files, the write policy.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any, NamedTuple

from radixserve.cache.radix_types import Tier
from radixserve.cache.tiers.block_io import BLOCK, Store, WriteDone
from radixserve.cache.tiers.block_keys import MissReason, StoreStatus
from radixserve.cache.tiers.block_loader import LoadDone
from radixserve.cache.tiers.load_choice import LoadChoice
from radixserve.kv_events.publisher import (
    MEDIUM_LOCAL_DISK,
    MEDIUM_SHARED,
    BlockEvent,
    BlockRemoved,
    BlockStored,
)

MEDIUMS = {Tier.LOCAL: MEDIUM_LOCAL_DISK, Tier.SHARED: MEDIUM_SHARED}
# Upper bounds (seconds) of the step-wait histogram's buckets; +Inf is implied.
STEP_WAIT_BUCKETS = (1e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05,
                     0.1, 0.25, 1.0)


class BlockTag(NamedTuple):
    """What a finished write needs to announce its block (kv_events)."""

    chain_hash: int
    parent: int | None
    tokens: tuple[int, ...]


class TierReport:
    def __init__(self, stores: dict[Tier, Store], sources: dict[Tier, Store],
                 choice: LoadChoice, emit: bool) -> None:
        """`stores`: what is written and evicted; `sources`: where blocks are read from (the
        host layer apart from the disk), the tiers the stats name."""
        self._stores = stores
        self._sources = sources
        self._choice = choice
        self._emit = emit
        self.hit_tokens = dict.fromkeys(sources, 0)
        self.errors: dict[str, int] = {}
        self.load_seconds = 0.0
        self.num_loads = 0
        self.events: list[BlockEvent] = []
        self._hash_of: dict[str, int] = {}  # keys this process stored -> chain hash (events)
        self.step_wait = 0.0  # tier work of the step in progress (KVTiers adds to it)
        self.wait_counts = [0] * (len(STEP_WAIT_BUCKETS) + 1)  # per bucket, not cumulative
        self.wait_sum = 0.0

    def end_step(self) -> None:
        self.wait_counts[bisect.bisect_left(STEP_WAIT_BUCKETS, self.step_wait)] += 1
        self.wait_sum += self.step_wait
        self.step_wait = 0.0

    def count_error(self, kind: str, n: int = 1) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + n

    def note_load(self, done: LoadDone) -> None:
        self.num_loads += 1
        self.load_seconds += done.seconds
        for tier, n in done.tokens_by_tier.items():
            self.hit_tokens[tier] = self.hit_tokens.get(tier, 0) + n
        # A store counts the misses it returns (stats() adds them in); a payload of the
        # wrong size is the loader's own finding.
        if done.layout_errors:
            self.count_error(MissReason.CORRUPT.value, done.layout_errors)

    def sync(self, writes: list[WriteDone]) -> list[str]:
        """Apply finished writes and the stores' evictions; the keys the tree must forget."""
        gone: list[str] = []
        for done in writes:
            tag = done.tag
            if done.status not in (StoreStatus.STORED, StoreStatus.EXISTS):
                self.count_error(f"write_{done.status.value}")
                gone.append(done.key)
            elif done.status is StoreStatus.STORED and self._emit and isinstance(tag, BlockTag):
                self._hash_of[done.key] = tag.chain_hash
                self.events.append(BlockStored((tag.chain_hash,), tag.parent, tag.tokens, BLOCK,
                                               MEDIUMS[done.tier]))
        for tier, store in self._stores.items():
            evicted = store.take_evicted()
            gone.extend(evicted)
            hashes = tuple(h for k in evicted if (h := self._hash_of.pop(k, None)) is not None)
            if hashes and self._emit:
                self.events.append(BlockRemoved(hashes, MEDIUMS[tier]))
        return gone

    def take_events(self) -> list[BlockEvent]:
        events, self.events = self.events, []
        return events

    def stats(self) -> dict[str, Any]:
        tiers = {}
        errors = dict(self.errors)
        for tier, store in self._sources.items():
            st = store.stats()
            rate = self._choice.rates[tier].rate
            tiers[tier.value] = {
                "num_blocks": st.num_blocks, "stored_tokens": st.num_blocks * BLOCK,
                "bytes_used": st.bytes_used, "capacity_bytes": st.capacity_bytes,
                "stored_bytes_total": st.stored_bytes_total,
                "loaded_bytes_total": st.loaded_bytes_total,
                "load_seconds_total": st.load_seconds_total,
                "store_seconds_total": st.store_seconds_total,
                "hit_tokens_total": self.hit_tokens.get(tier, 0),
                "load_bytes_per_s": rate,
                "choices_total": dict(self._choice.counts[tier]),
            }
            for kind, n in st.errors.items():
                errors[kind] = errors.get(kind, 0) + n
        measured = [r.rate for r in self._choice.rates.values() if r.rate is not None]
        return {"tiers": tiers, "errors": errors, "num_loads": self.num_loads,
                "load_seconds_total": self.load_seconds,
                "load_bytes_per_s": max(measured) if measured else None,
                "prefill_tokens_per_s": self._choice.prefill.tokens_per_s,
                "step_wait": {"buckets": list(STEP_WAIT_BUCKETS),
                              "counts": list(self.wait_counts), "sum": self.wait_sum}}

    def check_stores(self) -> None:
        """Each store recounts its index against what it holds (a block gone behind its back
        is reported by the next sync(), so the tree forgets it)."""
        for store in self._stores.values():
            store.check_integrity()

    def check_tree(self, tree_keys: dict[str, Tier], has: Callable[[Tier, str], bool]) -> None:
        """Every block key an offloaded node names is in its tier or being written. Call after
        check_stores() and a sync() whose pruning the tree applied, with no write in flight
        (a write's eviction would race the check)."""
        for key, tier in tree_keys.items():
            if tier in self._stores:
                assert has(tier, key), f"offloaded block {key} is in no tier"
