"""Writing KV blocks from the pool to the tier stores, off the step.

The block payload, the Store contract every tier store meets, and the writer thread
(demotions and write-through).

Owns: the byte layout of one block's payload, the writes captured but not yet stored (they
are readable meanwhile: a block evicted a moment ago is a hit, not a miss) and the write
results. Does not know: the radix tree, requests, which blocks to move or when (kv_tiers.py
decides), files (the stores), loads (block_loader.py).

Payload of one block (BLOCK tokens at absolute positions [16j, 16j + 16)): K then V, every
layer, in the pool's dtype: (2, num_layers, BLOCK, num_kv_heads, head_dim), C order.
Threads: the engine thread snapshots (copies the pages into a fresh tensor) before the pages
can be reused, so the writer only ever reads its own copy; it snapshots only blocks the writer
has room for (room()), so a block that would be dropped costs no copy.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from radixserve.cache.radix_types import Tier
from radixserve.cache.tiers.block_keys import LoadResult, StoreStatus, TierStats
from radixserve.kv_events.publisher import DEFAULT_BLOCK_SIZE

BLOCK = DEFAULT_BLOCK_SIZE
MAX_PENDING_BYTES = 512 << 20  # captured writes not yet stored; past it new writes are dropped
REFRESH_S = 1.0  # the writer re-scans refreshable stores (the shared tier) this often when idle


class Store(Protocol):
    """What every tier store (BlockStore, HostStore, LayeredStore) answers. Thread-safe."""

    tier: Tier

    def contains(self, key: str) -> bool: ...
    def keys(self) -> list[str]: ...
    def put(self, key: str, payload: bytes | memoryview) -> StoreStatus: ...
    def get(self, key: str) -> LoadResult: ...
    def get_buffer(self, key: str) -> torch.Tensor | None:
        """The block's payload as a host tensor the store keeps (pinned on CUDA: a load is
        one async copy), counted as a hit; None when the store has no such buffer."""
    def delete(self, key: str) -> None: ...
    def refresh(self, full: bool = True) -> None: ...
    def take_evicted(self) -> list[str]: ...
    def stats(self) -> TierStats: ...
    def check_integrity(self) -> None: ...


class KVCodec:
    """Block payloads <-> pool pages. k and v: (num_layers, num_slots, kv_heads, head_dim)."""

    def __init__(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k, self.v = k, v
        layers, _, heads, dim = k.shape
        self.shape = (2, layers, BLOCK, heads, dim)
        self.bytes_per_token = 2 * layers * heads * dim * k.element_size()
        self.block_bytes = BLOCK * self.bytes_per_token

    def snapshot(self, slots: Sequence[int]) -> torch.Tensor:
        """A host copy of the KV of `slots` (whole blocks' tokens, in order), one gather and
        one device-to-host copy for all of them: (num_blocks, 2, layers, BLOCK, heads, dim)."""
        idx = torch.tensor(slots, dtype=torch.int64, device=self.k.device)
        kv = torch.stack((self.k.index_select(1, idx), self.v.index_select(1, idx)))
        two, layers, _, heads, dim = kv.shape  # (2, layers, blocks * BLOCK, heads, dim)
        blocks = kv.view(two, layers, -1, BLOCK, heads, dim).permute(2, 0, 1, 3, 4, 5)
        return blocks.contiguous().cpu()  # (blocks, 2, layers, BLOCK, heads, dim)

    @staticmethod
    def payload(block: torch.Tensor) -> memoryview:
        return block.contiguous().view(torch.uint8).reshape(-1).numpy().data

    def write(self, data: bytes | memoryview | torch.Tensor, slots: Sequence[int],
              skip: int) -> None:
        """Copy tokens [skip, BLOCK) of a payload into `slots` (BLOCK - skip of them). A
        tensor payload (a store's pinned buffer) is copied to the device asynchronously on
        the current stream; the caller synchronizes it before the pages are read."""
        if isinstance(data, torch.Tensor):
            flat = data.view(self.k.dtype)
            non_blocking = data.is_pinned()
        else:
            flat = torch.frombuffer(bytearray(data), dtype=self.k.dtype)
            non_blocking = False
        block = flat.view(self.shape)[:, :, skip:]  # (2, layers, BLOCK - skip, heads, dim)
        idx = torch.tensor(slots, dtype=torch.int64, device=self.k.device)
        dev = block.to(self.k.device, non_blocking=non_blocking)
        # NOTE: torch has no index_copy_ for float8 (CPU or CUDA): an 8-bit pool takes the
        # payload as bytes, as kv_quant.store writes it.
        k, v = self.k, self.v
        if k.element_size() == 1:
            k, v, dev = k.view(torch.uint8), v.view(torch.uint8), dev.view(torch.uint8)
        k.index_copy_(1, idx, dev[0])
        v.index_copy_(1, idx, dev[1])


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

    def __init__(self, stores: dict[Tier, Store], refresh: Sequence[Store] = (),
                 max_pending_bytes: int = MAX_PENDING_BYTES) -> None:
        self._stores = stores
        self._refresh = list(refresh)
        self.max_pending_bytes = max_pending_bytes
        self._queue: queue.Queue[tuple[Tier, str, torch.Tensor, object] | None] = queue.Queue()
        self._lock = threading.Lock()
        self._pending: dict[tuple[Tier, str], torch.Tensor] = {}
        self._pending_bytes = 0
        self._done: list[WriteDone] = []
        self._stopping = False  # close(): skip what is still queued
        self._thread = threading.Thread(target=self._run, name="kv-writer", daemon=True)
        self._thread.start()

    def pending_bytes(self) -> int:
        """Bytes queued now (ask before taking a snapshot: only what fits is copied)."""
        return self._pending_bytes  # one int read: no lock; it only falls meanwhile

    def room(self, nbytes: int) -> bool:
        with self._lock:
            return self._pending_bytes + nbytes <= self.max_pending_bytes

    def submit(self, tier: Tier, key: str, block: torch.Tensor, tag: object = None) -> bool:
        """Queue a write of `block` (a snapshot); False (dropped) when too much is pending.
        A key already queued for `tier` is accepted as is."""
        nbytes = block.numel() * block.element_size()
        with self._lock:
            if (tier, key) in self._pending:
                return True
            if self._pending_bytes + nbytes > self.max_pending_bytes:
                return False
            self._pending[(tier, key)] = block
            self._pending_bytes += nbytes
        self._queue.put((tier, key, block, tag))
        return True

    def pending(self, tier: Tier, key: str) -> torch.Tensor | None:
        with self._lock:
            return self._pending.get((tier, key))

    def is_pending(self, tier: Tier, key: str) -> bool:
        return (tier, key) in self._pending  # one dict lookup: atomic without the lock

    def take_done(self) -> list[WriteDone]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def idle(self) -> bool:
        return self.num_pending() == 0

    def num_pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def wait_room(self, nbytes: int, deadline: float) -> bool:
        """Wait (shutdown only) until `nbytes` fit or the monotonic `deadline` passes."""
        while not self.room(nbytes):
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.002)
        return True

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until every queued write finished (tests, shutdown). False on timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.idle():
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
                    store.refresh(full=False)  # other replicas' new blocks become visible
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
