"""KVTiers: the local tier (--kv-offload-dir) and the shared tier (--kv-shared-dir) below the
KV pool, as the radix tree and the scheduler see them.

Owns: the stores, the block keys (kv_events chain hash, tenant salt included, + the model
fingerprint), what is written when (the write policy), the probe that continues a pool match
block by block through the tiers, the load-or-recompute decision (measured load bandwidth
against the measured prefill rate), the tier counters and the tier block events. Does not know:
requests or pages as allocations (sched/tier_loads.py), the tree's shape (it is the tree's
TierHooks: the tree tells it what was inserted and what is evicted).

Blocks: BLOCK (16) tokens at absolute positions [16j, 16j + 16), full blocks only. A block
belongs to the node its last token is in, so the tree's nodes split the blocks without overlap.
Write policy: "write_back" snapshots an evicted node's blocks into the local tier;
"write_through" writes every completed block when it enters the tree. The shared tier is
always written through (published as soon as a block is computed, off the step).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import torch

from radixserve.cache.radix_types import Demotion
from radixserve.cache.tiers import (
    BlockStore,
    Fingerprint,
    HostStore,
    MissReason,
    StoreStatus,
    Tier,
    block_key,
)
from radixserve.cache.tiers.block_io import (
    BLOCK,
    BlockRead,
    KVCodec,
    LoadDone,
    Store,
    TierLoader,
    TierWriter,
)
from radixserve.cache.tiers.layered_store import LayeredStore
from radixserve.kv_events.publisher import (
    MEDIUM_LOCAL_DISK,
    MEDIUM_SHARED,
    BlockEvent,
    BlockRemoved,
    BlockStored,
    block_hashes,
)

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_back", "write_through")
MEDIUMS = {Tier.LOCAL: MEDIUM_LOCAL_DISK, Tier.SHARED: MEDIUM_SHARED}
EMA = 0.2  # weight of the newest measurement in the running averages


class BlockTag(NamedTuple):
    """What a finished write needs to announce its block (kv_events)."""

    chain_hash: int
    parent: int | None
    tokens: tuple[int, ...]


class PoolPaths(Protocol):
    def pool_paths(self) -> Iterator[tuple[array[int], array[int], int, str]]: ...


@dataclass(frozen=True)
class TierSettings:
    local_dir: Path | None
    local_bytes: int
    shared_dir: Path | None
    shared_bytes: int
    write_policy: str = "write_back"
    host_bytes: int = 0  # > 0 (CUDA): a host-memory layer above the local disk
    durable: bool = True  # fsync every block (False: tests)


@dataclass(frozen=True)
class TierHit:
    """Blocks past the pool match that the tiers hold, in order, consecutive."""

    start: int  # the pool match (tokens before it are in the pool)
    end: int  # the end of the last block held (a multiple of BLOCK)
    keys: tuple[str, ...]
    tiers: tuple[Tier, ...]

    @property
    def num_tokens(self) -> int:
        return self.end - self.start


class RateAverage:
    """A running average of a rate (amount / seconds); None until measured."""

    def __init__(self) -> None:
        self.rate: float | None = None

    def add(self, amount: float, seconds: float) -> None:
        if amount <= 0 or seconds <= 0:
            return
        r = amount / seconds
        self.rate = r if self.rate is None else (1 - EMA) * self.rate + EMA * r


class KVTiers:
    def __init__(self, settings: TierSettings, fp: Fingerprint, codec: KVCodec,
                 emit_events: bool = False) -> None:
        if settings.write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {settings.write_policy!r}")
        self.settings = settings
        self.fp = fp
        self.codec = codec
        self.stores: dict[Tier, Store] = {}
        if settings.local_dir is not None:
            disk = BlockStore(settings.local_dir, settings.local_bytes, fp, Tier.LOCAL,
                              durable=settings.durable)
            self.stores[Tier.LOCAL] = disk if settings.host_bytes <= 0 else LayeredStore(
                HostStore(settings.host_bytes, fp, Tier.LOCAL), disk)
        if settings.shared_dir is not None:
            self.stores[Tier.SHARED] = BlockStore(settings.shared_dir, settings.shared_bytes, fp,
                                                  Tier.SHARED, durable=settings.durable)
        shared = [s for t, s in self.stores.items() if t is Tier.SHARED]
        self.writer = TierWriter(self.stores, refresh=shared)
        self.loader = TierLoader(codec, self.stores, self.writer.pending)
        self.load_rate = RateAverage()  # bytes/s of whole loads, as the worker measured them
        self.prefill_rate = RateAverage()  # tokens/s of prefill, from the engine's step timings
        self.hit_tokens = dict.fromkeys(self.stores, 0)
        self.errors: dict[str, int] = {}
        self.load_seconds = 0.0
        self.num_loads = 0
        self._emit = emit_events
        self.events: list[BlockEvent] = []
        self._hash_of: dict[str, int] = {}  # keys this process stored -> chain hash (events)

    # ---- the tree's hooks (step thread; the pages still hold the node's KV) --------------------

    def on_insert(self, tokens: array[int], slots: array[int], start: int, salt: str) -> None:
        targets = [Tier.SHARED] if Tier.SHARED in self.stores else []
        if self.settings.write_policy == "write_through" and Tier.LOCAL in self.stores:
            targets.append(Tier.LOCAL)
        if targets:
            self._write_blocks(tokens, slots, start, salt, targets)

    def on_evict(self, tokens: array[int], slots: array[int], start: int, salt: str
                 ) -> Demotion:
        if Tier.LOCAL in self.stores:
            tier = Tier.LOCAL
            if self.settings.write_policy == "write_back":
                return Demotion(tier, self._write_blocks(tokens, slots, start, salt, [tier]))
        elif Tier.SHARED in self.stores:
            tier = Tier.SHARED  # written through on insert
        else:
            return Demotion(None, ())
        first, end = start // BLOCK, len(tokens) // BLOCK
        hashes = block_hashes(tokens[: end * BLOCK], BLOCK, salt)[first:]
        return Demotion(tier if hashes else None, tuple(block_key(h, self.fp) for h in hashes))

    def _write_blocks(self, tokens: array[int], slots: array[int], start: int, salt: str,
                      targets: list[Tier]) -> tuple[str, ...]:
        """Queue the blocks ending in [start, len(tokens)) for `targets`; returns their keys."""
        first, end = start // BLOCK, len(tokens) // BLOCK
        if first >= end:
            return ()
        hashes = block_hashes(tokens[: end * BLOCK], BLOCK, salt)
        keys = []
        for j in range(first, end):
            key = block_key(hashes[j], self.fp)
            keys.append(key)
            todo = [t for t in targets if not self._has(t, key)]
            if not todo:
                continue
            snap = self.codec.snapshot(slots[j * BLOCK : (j + 1) * BLOCK])
            tag = BlockTag(hashes[j], hashes[j - 1] if j else None,
                           tuple(tokens[j * BLOCK : (j + 1) * BLOCK]))
            for t in todo:
                if not self.writer.submit(t, key, snap, tag):
                    self._count_error("write_dropped")
        return tuple(keys)

    def _has(self, tier: Tier, key: str) -> bool:
        return self.stores[tier].contains(key) or self.writer.pending(tier, key) is not None

    # ---- matching and loading ----------------------------------------------------------------

    def probe(self, token_ids: Sequence[int], salt: str, start: int) -> TierHit | None:
        """The blocks after the pool match `start` (token_ids is what may be matched: the
        prompt without its last token) that some tier holds, consecutive from the block
        containing `start`; None when the next block is nowhere."""
        end = len(token_ids) // BLOCK
        first = start // BLOCK
        if first >= end or not self.stores:
            return None
        hashes = block_hashes(token_ids[: end * BLOCK], BLOCK, salt)
        keys: list[str] = []
        tiers: list[Tier] = []
        for j in range(first, end):
            key = block_key(hashes[j], self.fp)
            tier = next((t for t in self.stores if self._has(t, key)), None)
            if tier is None:
                break
            keys.append(key)
            tiers.append(tier)
        if not keys:
            return None
        return TierHit(start, (first + len(keys)) * BLOCK, tuple(keys), tuple(tiers))

    def worth_loading(self, num_tokens: int) -> bool:
        """Load when the measured load time beats the measured recompute time. Until both are
        measured, load (loading is what measures it)."""
        load, prefill = self.load_rate.rate, self.prefill_rate.rate
        if load is None or prefill is None or num_tokens <= 0:
            return num_tokens > 0
        return num_tokens * self.codec.bytes_per_token / load < num_tokens / prefill

    def load(self, hit: TierHit, slots: Sequence[int]) -> Future[LoadDone]:
        """Read hit's blocks into `slots` (the pages of tokens [hit.start, hit.end))."""
        reads = []
        for i, (key, tier) in enumerate(zip(hit.keys, hit.tiers, strict=True)):
            lo = max(hit.start, (hit.start // BLOCK + i) * BLOCK)
            hi = (hit.start // BLOCK + i + 1) * BLOCK
            reads.append(BlockRead(key, tier, tuple(slots[lo - hit.start : hi - hit.start]),
                                   lo % BLOCK))
        return self.loader.submit(reads)

    def record_load(self, done: LoadDone) -> None:
        self.num_loads += 1
        self.load_seconds += done.seconds
        self.load_rate.add(done.bytes, done.seconds)
        for tier, n in done.tokens_by_tier.items():
            self.hit_tokens[tier] = self.hit_tokens.get(tier, 0) + n
        # A store counts the misses it returns (stats() adds them in); a payload of the
        # wrong size is the loader's own finding.
        if done.layout_errors:
            self._count_error(MissReason.CORRUPT.value, done.layout_errors)

    def note_prefill(self, num_tokens: int, seconds: float) -> None:
        self.prefill_rate.add(num_tokens, seconds)

    # ---- results of the worker threads (step thread) -----------------------------------------

    def sync(self) -> list[str]:
        """Apply finished writes and the stores' evictions; returns the keys the tree must
        forget (evicted, or their write failed)."""
        gone: list[str] = []
        for done in self.writer.take_done():
            if done.status in (StoreStatus.STORED, StoreStatus.EXISTS):
                tag = done.tag
                if done.status is StoreStatus.STORED and self._emit and isinstance(tag, BlockTag):
                    self._hash_of[done.key] = tag.chain_hash
                    self.events.append(BlockStored((tag.chain_hash,), tag.parent, tag.tokens,
                                                   BLOCK, MEDIUMS[done.tier]))
            else:
                self._count_error(f"write_{done.status.value}")
                gone.append(done.key)
        for tier, store in self.stores.items():
            evicted = store.take_evicted()  # type: ignore[attr-defined]
            gone.extend(evicted)
            hashes = tuple(h for k in evicted if (h := self._hash_of.pop(k, None)) is not None)
            if hashes and self._emit:
                self.events.append(BlockRemoved(hashes, MEDIUMS[tier]))
        return gone

    def take_events(self) -> list[BlockEvent]:
        events, self.events = self.events, []
        return events

    def _count_error(self, kind: str, n: int = 1) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + n

    # ---- observability -----------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        tiers = {}
        errors = dict(self.errors)
        for tier, store in self.stores.items():
            st = store.stats()  # type: ignore[attr-defined]
            tiers[tier.value] = {
                "num_blocks": st.num_blocks, "stored_tokens": st.num_blocks * BLOCK,
                "bytes_used": st.bytes_used, "capacity_bytes": st.capacity_bytes,
                "stored_bytes_total": st.stored_bytes_total,
                "loaded_bytes_total": st.loaded_bytes_total,
                "load_seconds_total": st.load_seconds_total,
                "store_seconds_total": st.store_seconds_total,
                "hit_tokens_total": self.hit_tokens.get(tier, 0),
            }
            for kind, n in st.errors.items():
                errors[kind] = errors.get(kind, 0) + n
        return {"tiers": tiers, "errors": errors, "num_loads": self.num_loads,
                "load_seconds_total": self.load_seconds,
                "write_policy": self.settings.write_policy, **self.rates()}

    def rates(self) -> dict[str, float | None]:
        load, prefill = self.load_rate.rate, self.prefill_rate.rate
        per_token = self.codec.bytes_per_token
        return {"load_bytes_per_s": load, "prefill_tokens_per_s": prefill,
                "load_tokens_per_s": None if load is None else load / per_token}

    def check_stores(self) -> None:
        """Each store recounts its index against what it holds (a block gone behind its back
        is reported by the next sync(), so the tree forgets it)."""
        for store in self.stores.values():
            store.check_integrity()  # type: ignore[attr-defined]

    def check_tree(self, tree_keys: dict[str, Tier]) -> None:
        """Every block key an offloaded LOCAL node names is in the local tier or being written.
        Call after check_stores() and a sync() whose pruning the tree applied, with no write
        in flight (a write's eviction would race the check)."""
        if Tier.LOCAL not in self.stores:
            return
        for key, tier in tree_keys.items():
            if tier is Tier.LOCAL:
                assert self._has(Tier.LOCAL, key), f"offloaded block {key} is in no tier"

    def persist(self, cache: PoolPaths, timeout: float = 60.0) -> bool:
        """Write every block of the pool to the local tier and wait for the writes (a clean
        shutdown with write-back: the next process starts warm). False on timeout."""
        if Tier.LOCAL in self.stores and self.settings.write_policy == "write_back":
            for tokens, slots, start, salt in cache.pool_paths():
                self._write_blocks(tokens, slots, start, salt, [Tier.LOCAL])
        return self.writer.flush(timeout)

    def describe(self) -> dict[str, Any]:
        """The static settings (server_info's engine_info)."""
        s = self.settings
        return {"local_dir": None if s.local_dir is None else str(s.local_dir),
                "local_size_bytes": s.local_bytes if s.local_dir is not None else None,
                "shared_dir": None if s.shared_dir is None else str(s.shared_dir),
                "write_policy": s.write_policy, "block_size": BLOCK,
                "host_size_bytes": s.host_bytes or None, "fingerprint": self.fp.canonical(),
                "bytes_per_token": self.codec.bytes_per_token}

    def close(self) -> None:
        self.writer.close()
        self.loader.close()


def fingerprint(model: str, dtype: torch.dtype, num_layers: int, num_kv_heads: int,
                head_dim: int) -> Fingerprint:
    return Fingerprint(model, str(dtype).removeprefix("torch."), num_layers, num_kv_heads,
                       head_dim, BLOCK)
