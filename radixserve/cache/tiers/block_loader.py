"""Reading a request's tier blocks back into pool pages, off the step.

The load jobs and the loader threads.

Owns: the loader threads (several loads in flight at once, so one large load never delays
the others), their CUDA streams, and what a load reports (blocks landed, per-tier bytes and
seconds for the load-or-recompute choice, misses). Does not know: the radix tree, requests,
which blocks to load or whether (kv_tiers.py and load_choice.py decide), files (the stores).

A load writes into pages that a waiting request's load holds and nothing else reads until the
load is done. On CUDA a block the host layer holds is one asynchronous copy from its pinned
buffer on the thread's side stream; the stream is synchronized once, at the end of the load.
The side stream first waits on an event recorded on the compute stream when the load was
submitted: the pages may have belonged to a request aborted a moment ago whose last forward
(its rope_qk_store into them) is still queued there.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from radixserve.cache.radix_types import Tier
from radixserve.cache.tiers.block_io import KVCodec, Store
from radixserve.cache.tiers.block_keys import MissReason

LOAD_WORKERS = 4  # loads in flight at once


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
    bytes_by_tier: dict[Tier, int] = field(default_factory=dict)
    seconds_by_tier: dict[Tier, float] = field(default_factory=dict)
    miss: MissReason | None = None  # why it stopped early (None: every block loaded)
    miss_tier: Tier | None = None
    # Misses another tier made good (a corrupt local block read from the shared tier).
    recovered: list[tuple[MissReason, Tier]] = field(default_factory=list)
    # Payloads of the wrong size (another layout): the stores count their own misses, so
    # these are the only errors the loader alone saw.
    layout_errors: int = 0

    def add(self, tier: Tier, num_tokens: int, nbytes: int, seconds: float) -> None:
        self.num_blocks += 1
        self.num_tokens += num_tokens
        self.bytes += nbytes
        self.tokens_by_tier[tier] = self.tokens_by_tier.get(tier, 0) + num_tokens
        self.bytes_by_tier[tier] = self.bytes_by_tier.get(tier, 0) + nbytes
        self.seconds_by_tier[tier] = self.seconds_by_tier.get(tier, 0.0) + seconds


Payload = bytes | memoryview | torch.Tensor


class CudaSideStreams:
    """One side stream per loader thread; a load's stream waits on the compute stream's work
    queued before the load was submitted."""

    def __init__(self) -> None:
        self._local = threading.local()

    def mark(self) -> object:
        """On the submitting (engine) thread: an event after the compute stream's queue."""
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
        return event

    @contextlib.contextmanager
    def side(self, after: object) -> Iterator[None]:
        """On a loader thread: the copies queued inside run after `after`; on exit they are
        complete (the pages are whole before the request runs)."""
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
        assert isinstance(after, torch.cuda.Event)
        stream.wait_event(after)
        with torch.cuda.stream(stream):
            yield
        stream.synchronize()


class TierLoader:
    """Loads run on LOAD_WORKERS threads; the caller polls the future (never blocks a step).
    `streams`: the side streams (CUDA's by default on a CUDA pool; tests pass fakes)."""

    def __init__(self, codec: KVCodec, stores: dict[Tier, Store],
                 pending: Callable[[Tier, str], torch.Tensor | None],
                 streams: CudaSideStreams | None = None) -> None:
        self._codec = codec
        self._stores = stores
        self._pending = pending
        self._pool = ThreadPoolExecutor(LOAD_WORKERS, thread_name_prefix="kv-loader")
        self._cuda = codec.k.device.type == "cuda"
        self._streams = streams if streams is not None or not self._cuda else CudaSideStreams()

    def submit(self, reads: list[BlockRead]) -> Future[LoadDone]:
        after = self._streams.mark() if self._streams is not None else None
        return self._pool.submit(self._load, reads, after)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _load(self, reads: list[BlockRead], after: object) -> LoadDone:  # on a loader thread
        t0 = time.perf_counter()
        done = LoadDone(0, 0, 0.0, 0)
        if self._streams is not None:
            with self._streams.side(after):
                self._read_all(reads, done)
        else:
            self._read_all(reads, done)
        done.seconds = time.perf_counter() - t0
        return done

    def _read_all(self, reads: list[BlockRead], done: LoadDone) -> None:
        for read in reads:
            t0 = time.perf_counter()
            got = self._fetch(read.key, read.tier, done)
            if got is None:
                return
            data, tier = got
            self._codec.write(data, read.slots, read.skip)
            done.add(tier, len(read.slots), self._codec.block_bytes, time.perf_counter() - t0)

    def _fetch(self, key: str, tier: Tier, done: LoadDone) -> tuple[Payload, Tier] | None:
        """The block's payload from `tier`, else from another tier that holds it (a bad
        local copy is not the end when the shared tier has a good one); None: a miss."""
        first: tuple[MissReason, Tier] | None = None
        for t in (tier, *(o for o in self._stores if o != tier)):
            data = self._read(t, key, t == tier)
            if isinstance(data, MissReason):
                first = first or (data, t)
                continue
            if data is None:
                continue
            size = data.numel() if isinstance(data, torch.Tensor) else len(data)
            if size != self._codec.block_bytes:
                done.layout_errors += 1
                first = first or (MissReason.CORRUPT, t)  # another layout
                continue
            if first is not None:
                done.recovered.append(first)
            return data, t
        assert first is not None
        done.miss, done.miss_tier = first
        return None

    def _read(self, tier: Tier, key: str, named: bool) -> Payload | MissReason | None:
        """A payload, a miss, or None (another tier that does not hold the key)."""
        block = self._pending(tier, key)
        if block is not None:
            return KVCodec.payload(block)
        store = self._stores[tier]
        if not named and not store.contains(key):
            return None
        buf = store.get_buffer(key) if self._cuda else None
        if buf is not None:
            return buf
        result = store.get(key)
        if result.data is None:
            return result.miss or MissReason.ABSENT
        return result.data
