"""Moving KV blocks between the pool and the tier stores off the step: the block payload, the
writer thread (demotions and write-through) and the loader thread (a request's prefix).

Owns: the byte layout of one block's payload, the writes captured but not yet stored (they
are readable meanwhile: a block evicted a moment ago is a hit, not a miss), the write results
and the load jobs. Does not know: the radix tree, requests, which blocks to move or when
(kv_tiers.py decides), files (the stores).

Payload of one block (BLOCK tokens at absolute positions [16j, 16j + 16)): K then V, every
layer, in the pool's dtype: (2, num_layers, BLOCK, num_kv_heads, head_dim), C order.
Threads: the engine thread snapshots (copies the pages into a fresh tensor) before the pages
can be reused, so the writer only ever reads its own copy. The loader writes into pages that a
waiting request holds and nothing else reads until the load is done.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

import torch

from radixserve.cache.radix_types import Tier
from radixserve.cache.tiers.block_keys import LoadResult, MissReason, StoreStatus
from radixserve.kv_events.publisher import DEFAULT_BLOCK_SIZE

BLOCK = DEFAULT_BLOCK_SIZE
MAX_PENDING_BYTES = 512 << 20  # captured writes not yet stored; past it new writes are dropped
REFRESH_S = 1.0  # the writer re-scans refreshable stores (the shared tier) this often when idle


class Store(Protocol):
    """The part of BlockStore / HostStore this module uses."""

    def contains(self, key: str) -> bool: ...
    def put(self, key: str, payload: bytes | memoryview) -> StoreStatus: ...
    def get(self, key: str) -> LoadResult: ...
    def refresh(self) -> None: ...


class KVCodec:
    """Block payloads <-> pool pages. k and v: (num_layers, num_slots, kv_heads, head_dim)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v
        layers, _, heads, dim = k.shape
        self.shape = (2, layers, BLOCK, heads, dim)
        self.bytes_per_token = 2 * layers * heads * dim * k.element_size()
        self.block_bytes = BLOCK * self.bytes_per_token

    def snapshot(self, slots: Sequence[int]) -> torch.Tensor:
        """A host copy of the KV of `slots` (one block's tokens, in order)."""
        idx = torch.tensor(slots, dtype=torch.int64, device=self.k.device)
        out = torch.stack((self.k.index_select(1, idx), self.v.index_select(1, idx)))
        return out.cpu()  # (2, layers, BLOCK, heads, dim); on CUDA a D2H copy, done here

    @staticmethod
    def payload(block: torch.Tensor) -> memoryview:
        return block.contiguous().view(torch.uint8).reshape(-1).numpy().data

    def write(self, data: bytes | memoryview, slots: Sequence[int], skip: int) -> None:
        """Copy tokens [skip, BLOCK) of a payload into `slots` (BLOCK - skip of them)."""
        flat = torch.frombuffer(bytearray(data), dtype=self.k.dtype)
        block = flat.view(self.shape)[:, :, skip:]  # (2, layers, BLOCK - skip, heads, dim)
        idx = torch.tensor(slots, dtype=torch.int64, device=self.k.device)
        dev = block.to(self.k.device, non_blocking=False)
        self.k.index_copy_(1, idx, dev[0])
        self.v.index_copy_(1, idx, dev[1])


@dataclass(frozen=True)
class WriteDone:
    tier: Tier
    key: str
    status: StoreStatus
    seconds: float
    tag: object  # the caller's (kv_tiers: the block's event), returned as given


class TierWriter:
    """One thread that puts captured blocks into stores, in order; results are drained by
    the engine thread. `refresh` stores are re-scanned every REFRESH_S while it idles."""

    def __init__(self, stores: dict[Tier, Store], refresh: Sequence[Store] = ()) -> None:
        self._stores = stores
        self._refresh = list(refresh)
        self._queue: queue.Queue[tuple[Tier, str, torch.Tensor, object] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._pending: dict[tuple[Tier, str], torch.Tensor] = {}
        self._pending_bytes = 0
        self._done: list[WriteDone] = []
        self.num_dropped = 0
        self._stopping = False  # close(): skip what is still queued
        self._thread = threading.Thread(target=self._run, name="kv-writer", daemon=True)
        self._thread.start()

    def submit(self, tier: Tier, key: str, block: torch.Tensor, tag: object = None) -> bool:
        """Queue a write of `block` (a snapshot); False (dropped) when already queued or too
        much is pending."""
        nbytes = block.numel() * block.element_size()
        with self._lock:
            if (tier, key) in self._pending:
                return True
            if self._pending_bytes + nbytes > MAX_PENDING_BYTES:
                self.num_dropped += 1
                return False
            self._pending[(tier, key)] = block
            self._pending_bytes += nbytes
        self._queue.put((tier, key, block, tag))
        return True

    def pending(self, tier: Tier, key: str) -> torch.Tensor | None:
        with self._lock:
            return self._pending.get((tier, key))

    def take_done(self) -> list[WriteDone]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def idle(self) -> bool:
        with self._lock:
            return not self._pending

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write finished (tests, shutdown). False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._pending:
                    return True
            time.sleep(0.002)
        return False

    def close(self) -> None:
        """Stop the thread; writes still queued are dropped (each store write is atomic, so
        nothing half-written is left behind)."""
        self._stopping = True
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _run(self) -> None:
        last_refresh = 0.0
        while True:
            try:
                item = self._queue.get(timeout=REFRESH_S)
            except queue.Empty:
                item = None
                if not self._refresh:
                    continue
            else:
                if item is None:
                    return  # close()
            now = time.monotonic()
            if self._refresh and (item is None or now - last_refresh >= REFRESH_S):
                for store in self._refresh:
                    store.refresh()  # other replicas' new blocks become visible
                last_refresh = now
            if item is not None and not self._stopping:
                self._write(*item)

    def _write(self, tier: Tier, key: str, block: torch.Tensor, tag: object) -> None:
        t0 = time.perf_counter()
        status = self._stores[tier].put(key, KVCodec.payload(block))
        done = WriteDone(tier, key, status, time.perf_counter() - t0, tag)
        with self._lock:
            del self._pending[(tier, key)]
            self._pending_bytes -= block.numel() * block.element_size()
            self._done.append(done)


@dataclass(frozen=True)
class BlockRead:
    """One block of a load: its key, the tier to read, and where its tokens go."""

    key: str
    tier: Tier
    slots: tuple[int, ...]  # pool slots of tokens [skip, BLOCK) of the block
    skip: int  # leading tokens already in the pool (the pool match ended inside the block)


@dataclass
class LoadDone:
    """What a load did: the first `num_blocks` reads landed; the rest did not run."""

    num_blocks: int
    num_tokens: int
    seconds: float
    bytes: int
    tokens_by_tier: dict[Tier, int] = field(default_factory=dict)
    miss: MissReason | None = None  # why it stopped early (None: every block loaded)
    miss_tier: Tier | None = None
    # Misses another tier made good (a corrupt local block read from the shared tier).
    recovered: list[tuple[MissReason, Tier]] = field(default_factory=list)
    # Payloads of the wrong size (another layout): the stores count their own misses, so
    # these are the only errors the loader alone saw.
    layout_errors: int = 0


class TierLoader:
    """Loads run on one worker thread; the caller polls the future (never blocks a step)."""

    def __init__(self, codec: KVCodec, stores: dict[Tier, Store],
                 pending: Callable[[Tier, str], torch.Tensor | None]) -> None:
        self._codec = codec
        self._stores = stores
        self._pending = pending
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kv-loader")
        cuda = codec.k.device.type == "cuda"
        self._stream = torch.cuda.Stream() if cuda else None  # type: ignore[no-untyped-call]

    def submit(self, reads: list[BlockRead]) -> Future[LoadDone]:
        return self._pool.submit(self._load, reads)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _load(self, reads: list[BlockRead]) -> LoadDone:  # on the worker thread
        t0 = time.perf_counter()
        done = LoadDone(0, 0, 0.0, 0)
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                self._read_all(reads, done)
            self._stream.synchronize()  # the pages are complete before the request runs
        else:
            self._read_all(reads, done)
        done.seconds = time.perf_counter() - t0
        return done

    def _read_all(self, reads: list[BlockRead], done: LoadDone) -> None:
        for read in reads:
            got = self._fetch(read.key, read.tier, done)
            if got is None:
                return
            data, tier = got
            self._codec.write(data, read.slots, read.skip)
            n = len(read.slots)
            done.num_blocks += 1
            done.num_tokens += n
            done.bytes += len(data)
            done.tokens_by_tier[tier] = done.tokens_by_tier.get(tier, 0) + n

    def _fetch(self, key: str, tier: Tier, done: LoadDone
               ) -> tuple[bytes | memoryview, Tier] | None:
        """The block's payload from `tier`, else from another tier that holds it (a bad
        local copy is not the end when the shared tier has a good one); None: a miss."""
        first: tuple[MissReason, Tier] | None = None
        for t in (tier, *(o for o in self._stores if o != tier)):
            block = self._pending(t, key)
            if block is not None:
                data: bytes | memoryview = KVCodec.payload(block)
            elif t == tier or self._stores[t].contains(key):
                result = self._stores[t].get(key)
                if result.data is None:
                    first = first or (result.miss or MissReason.ABSENT, t)
                    continue
                data = result.data
            else:
                continue
            if len(data) != self._codec.block_bytes:
                done.layout_errors += 1
                first = first or (MissReason.CORRUPT, t)  # another layout
                continue
            if first is not None:
                done.recovered.append(first)
            return data, t
        assert first is not None
        done.miss, done.miss_tier = first
        return None
