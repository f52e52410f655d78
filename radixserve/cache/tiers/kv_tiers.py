"""KVTiers: the local and shared tiers below the KV pool, as the tree and scheduler see them.

The local tier is --kv-offload-dir, the shared tier --kv-shared-dir.

Owns: the stores, the block keys (kv_events chain hash, tenant salt included, + the model
fingerprint), what is written when (the write policy), the probe that continues a pool match
block by block through the tiers, the tier counters, the tier block events, and the time the
step spends on tier work. Does not know: requests or pages as allocations
(sched/tier_loads.py), the tree's shape (it is the tree's TierHooks: the tree tells it what
was inserted and what is evicted), how the load-or-recompute choice is made (load_choice.py).

Blocks: BLOCK (16) tokens at absolute positions [16j, 16j + 16), full blocks only. A block
belongs to the node its last token is in, so the tree's nodes split the blocks without overlap.
Write policy: "write_back" snapshots an evicted node's blocks into the local tier;
"write_through" writes every completed block when it enters the tree. The shared tier is
always written through (published as soon as a block is computed, off the step), under its
own subdirectory per model fingerprint (replicas of other models never see its blocks).
No ghost nodes: an evicted node is offloaded only when every one of its blocks is held or
queued in the tier; a block that was dropped (writer full) makes the eviction a removal, and a
write that fails later prunes the node (sync()).
"""

from __future__ import annotations

import itertools
import logging
import time
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Concatenate, NamedTuple, ParamSpec, TypeVar

import torch

from radixserve.cache.radix_types import Demotion
from radixserve.cache.tiers import BlockStore, Fingerprint, HostStore, Tier, block_key
from radixserve.cache.tiers.block_io import BLOCK, KVCodec, Store, TierWriter
from radixserve.cache.tiers.block_loader import BlockRead, LoadDone, TierLoader
from radixserve.cache.tiers.chain_memo import ChainMemo
from radixserve.cache.tiers.layered_store import LayeredStore, read_sources
from radixserve.cache.tiers.load_choice import Choice, LoadChoice
from radixserve.cache.tiers.tier_report import BlockTag, TierReport
from radixserve.cache.tiers.tier_types import PoolPaths, TierHit, TierSettings
from radixserve.kv_events.publisher import BlockEvent

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_back", "write_through")
P = ParamSpec("P")
R = TypeVar("R")


class _Write(NamedTuple):
    """A block to queue: its index on the path, key, event tag, and the tiers lacking it."""

    block: int
    key: str
    tag: BlockTag
    tiers: list[Tier]


def _on_step(fn: Callable[Concatenate[KVTiers, P], R]) -> Callable[Concatenate[KVTiers, P], R]:
    """Count the call's time as the step's wait on tier work (the engine thread's calls)."""

    def timed(self: KVTiers, /, *args: P.args, **kwargs: P.kwargs) -> R:
        t0 = time.perf_counter()
        try:
            return fn(self, *args, **kwargs)
        finally:
            self.report.step_wait += time.perf_counter() - t0

    timed.__doc__ = fn.__doc__
    return timed


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
                HostStore(settings.host_bytes, fp, Tier.HOST), disk)
        if settings.shared_dir is not None:  # one subdirectory per model fingerprint
            self.stores[Tier.SHARED] = BlockStore(shared_namespace(settings.shared_dir, fp),
                                                  settings.shared_bytes, fp, Tier.SHARED,
                                                  durable=settings.durable)
        shared = [s for t, s in self.stores.items() if t is Tier.SHARED]
        self.writer = TierWriter(self.stores, shared, settings.max_pending_bytes)
        # Where blocks are read from: host memory, the local disk and the shared directory
        # each have their own load rate (a slow disk never turns host-memory hits away).
        self.sources = read_sources(self.stores)
        self.loader = TierLoader(codec, self.sources, self._pending)
        self.choice = LoadChoice(list(self.sources), codec.bytes_per_token)
        self.report = TierReport(self.stores, self.sources, self.choice, emit_events)
        self._memo = ChainMemo()

    # ---- the tree's hooks (step thread; the pages still hold the node's KV) --------------------

    @_on_step
    def on_insert(self, tokens: array[int], slots: array[int], start: int, salt: str) -> None:
        targets = [Tier.SHARED] if Tier.SHARED in self.stores else []
        if self.settings.write_policy == "write_through" and Tier.LOCAL in self.stores:
            targets.append(Tier.LOCAL)
        if targets:
            self._write_blocks(tokens, slots, start, salt, targets)

    @_on_step
    def on_evict(self, tokens: array[int], slots: array[int], start: int, salt: str
                 ) -> Demotion:
        """Offload the node when its tier holds (or is writing) every one of its blocks;
        otherwise it is removed (no ghost: the tree never names a block no tier will hold)."""
        if Tier.LOCAL in self.stores:
            tier = Tier.LOCAL
            if self.settings.write_policy == "write_back":
                keys = self._write_blocks(tokens, slots, start, salt, [tier])
                return Demotion(tier if keys else None, keys or ())
        elif Tier.SHARED in self.stores:
            tier = Tier.SHARED  # written through on insert
        else:
            return Demotion(None, ())
        _, hashes = self._span(tokens, start, salt)
        keys = tuple(block_key(h, self.fp) for h in hashes)
        if not keys or not all(self._has(tier, k) for k in keys):
            return Demotion(None, ())
        return Demotion(tier, keys)

    def _span(self, tokens: Sequence[int], start: int, salt: str
              ) -> tuple[int | None, list[int]]:
        """(the parent's chain hash, the chain hashes of the blocks ending in [start, end))."""
        return self._memo.span(tokens, salt, start // BLOCK, len(tokens) // BLOCK)

    def _write_blocks(self, tokens: array[int], slots: array[int], start: int, salt: str,
                      targets: list[Tier], deadline: float | None = None
                      ) -> tuple[str, ...] | None:
        """Queue the blocks ending in [start, len(tokens)) for `targets`. Returns their keys,
        or None when a block was dropped (the writer is full; with a `deadline`, shutdown,
        it waits for room until then). Only blocks that will be written are copied."""
        parent, hashes = self._span(tokens, start, salt)
        first = start // BLOCK
        keys, todo = [], []
        for i, h in enumerate(hashes):
            key = block_key(h, self.fp)
            keys.append(key)
            need = [t for t in targets if not self._has(t, key)]
            if need:
                tag = BlockTag(h, parent if i == 0 else hashes[i - 1],
                               tuple(tokens[(first + i) * BLOCK : (first + i + 1) * BLOCK]))
                todo.append(_Write(first + i, key, tag, need))
        queued = 0
        if deadline is None:  # the blocks that fit now, snapshot together
            room = self.writer.max_pending_bytes - self.writer.pending_bytes()
            sizes = itertools.accumulate(len(w.tiers) * self.codec.block_bytes for w in todo)
            queued = self._submit(todo[: sum(1 for n in sizes if n <= room)], slots)
        else:  # shutdown: each block as soon as there is room for it
            for w in todo:
                if self.writer.wait_room(len(w.tiers) * self.codec.block_bytes, deadline):
                    queued += self._submit([w], slots)
        if queued < len(todo):
            self.report.count_error("write_dropped", len(todo) - queued)
        return tuple(keys) if queued == len(todo) else None

    def _submit(self, writes: list[_Write], slots: array[int]) -> int:
        if not writes:
            return 0
        blocks = self.codec.snapshot([s for w in writes
                                      for s in slots[w.block * BLOCK : (w.block + 1) * BLOCK]])
        for block, w in zip(blocks, writes, strict=True):  # block: (2, layers, BLOCK, h, d)
            for tier in w.tiers:
                self.writer.submit(tier, w.key, block, w.tag)
        return len(writes)

    def _has(self, tier: Tier, key: str) -> bool:
        return self.stores[tier].contains(key) or self.writer.is_pending(tier, key)

    def _where(self, key: str) -> Tier | None:
        """The first read source holding `key` (a block being written counts as its host
        layer's when there is one: it is in memory)."""
        return next((t for t, store in self.sources.items()
                     if store.contains(key) or self.writer.is_pending(_written_as(t), key)),
                    None)

    def _pending(self, source: Tier, key: str) -> torch.Tensor | None:
        return self.writer.pending(_written_as(source), key)

    # ---- matching and loading ----------------------------------------------------------------

    @_on_step
    def probe(self, token_ids: Sequence[int], salt: str, start: int) -> TierHit | None:
        """The blocks after the pool match `start` (token_ids is what may be matched: the
        prompt without its last token) that some tier holds, consecutive from the block
        containing `start`; None when the next block is nowhere."""
        if not self.stores:
            return None
        first = start // BLOCK
        keys: list[str] = []
        tiers: list[Tier] = []
        for h in self._span(token_ids, start - start % BLOCK, salt)[1]:
            key = block_key(h, self.fp)
            tier = self._where(key)
            if tier is None:
                break
            keys.append(key)
            tiers.append(tier)
        if not keys:
            return None
        return TierHit(start, (first + len(keys)) * BLOCK, tuple(keys), tuple(tiers))

    @_on_step
    def choose(self, hit: TierHit) -> TierHit | None:
        """The part of `hit` worth loading (load_choice.py), or None: recompute it all."""
        decision = self.choice.decide(hit.start, hit.block_ends(), hit.tiers)
        n = decision.num_blocks
        if n == 0:
            return None
        return TierHit(hit.start, hit.block_ends()[n - 1], hit.keys[:n], hit.tiers[:n],
                       decision.choice is Choice.PROBE)

    @_on_step
    def load(self, hit: TierHit, slots: Sequence[int]) -> Future[LoadDone]:
        """Read hit's blocks into `slots` (the pages of tokens [hit.start, hit.end))."""
        reads = []
        for key, tier, end in zip(hit.keys, hit.tiers, hit.block_ends(), strict=True):
            lo = max(hit.start, end - BLOCK)
            reads.append(BlockRead(key, tier, tuple(slots[lo - hit.start : end - hit.start]),
                                   lo % BLOCK))
        return self.loader.submit(reads)

    def record_load(self, done: LoadDone) -> None:
        self.choice.note_load(done.bytes_by_tier, done.seconds_by_tier)
        self.report.note_load(done)

    def note_prefill(self, num_tokens: int, mean_pos: float, seconds: float) -> None:
        """A prefill step's timing: `num_tokens` new tokens at mean position `mean_pos`."""
        self.choice.prefill.add(num_tokens, mean_pos, seconds)

    def end_step(self) -> None:
        """The engine's step ended: its tier work joins the step-wait histogram."""
        self.report.end_step()

    # ---- results of the worker threads (step thread) -----------------------------------------

    @_on_step
    def sync(self) -> list[str]:
        """Apply finished writes and the stores' evictions; returns the keys the tree must
        forget (evicted, or their write failed)."""
        return self.report.sync(self.writer.take_done())

    # ---- shutdown ------------------------------------------------------------------------------

    def persist(self, cache: PoolPaths, timeout: float = 30.0) -> int:
        """Write every block of the pool to the local tier (write-back) and wait for every
        pending write, all within `timeout` seconds (a clean shutdown: the next process starts
        warm). Returns the blocks not written (logged)."""
        deadline = time.monotonic() + timeout
        before = self.report.errors.get("write_dropped", 0)
        if Tier.LOCAL in self.stores and self.settings.write_policy == "write_back":
            for tokens, slots, start, salt in cache.pool_paths():
                self._write_blocks(tokens, slots, start, salt, [Tier.LOCAL], deadline)
        dropped = self.report.errors.get("write_dropped", 0) - before
        if not self.writer.flush(max(0.0, deadline - time.monotonic())):
            dropped += self.writer.num_pending()
        if dropped:
            logger.warning("KV tiers: %d block writes not done within the %.0fs shutdown timeout "
                           "(--kv-offload-shutdown-timeout); those blocks are not warm",
                           dropped, timeout)
        else:
            logger.info("KV tiers: every pending block written in %.1f s at shutdown",
                        timeout - (deadline - time.monotonic()))
        return dropped

    # ---- observability (tier_report.py) -------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        return {**self.report.stats(), "write_policy": self.settings.write_policy}

    def take_events(self) -> list[BlockEvent]:
        return self.report.take_events()

    def check_stores(self) -> None:
        self.report.check_stores()

    def check_tree(self, tree_keys: dict[str, Tier]) -> None:
        self.report.check_tree(tree_keys, self._has)

    def describe(self) -> dict[str, Any]:
        """The static settings (server_info's engine_info)."""
        s = self.settings
        return {"local_dir": None if s.local_dir is None else str(s.local_dir),
                "local_size_bytes": s.local_bytes if s.local_dir is not None else None,
                "shared_dir": None if s.shared_dir is None else str(s.shared_dir),
                "shared_size_bytes": s.shared_bytes if s.shared_dir is not None else None,
                "write_policy": s.write_policy, "block_size": BLOCK,
                "host_size_bytes": s.host_bytes or None, "fingerprint": self.fp.canonical(),
                "bytes_per_token": self.codec.bytes_per_token}

    def close(self) -> None:
        self.writer.close()
        self.loader.close()


def _written_as(source: Tier) -> Tier:
    """The store a read source's blocks are written through (the host layer: the local's)."""
    return Tier.LOCAL if source is Tier.HOST else source


def shared_namespace(shared_dir: Path, fp: Fingerprint) -> Path:
    """Where replicas whose KV has fingerprint `fp` share blocks under --kv-shared-dir."""
    return shared_dir / f"kv-{fp.digest()}"


def fingerprint(model: str, dtype: torch.dtype, num_layers: int, num_kv_heads: int,
                head_dim: int) -> Fingerprint:
    return Fingerprint(model, str(dtype).removeprefix("torch."), num_layers, num_kv_heads,
                       head_dim, BLOCK)

