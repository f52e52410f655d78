"""KV-cache block events: the block hash chain, the event types, and the replica's publisher.

Owns: the hash a replica and the router must agree on, the wire format of `/kv_events`, and
the conversion of the radix cache's node-level events into block-level ones (whose batches
also go to `listeners`: kv_events_zmq.py publishes them in vLLM's format). Does not know:
HTTP (server/routes/kv_events.py streams batches), the radix tree itself (its `CacheEvent` is
duck-typed: `kind`, `token_ids`, `prefix_len`, `salt`).

The block hash (a hash that differs across processes silently turns every lookup into a
miss, so it is spelled out here and pinned by a test against xxhash itself; with
`--prefix-caching-hash-algo sha256_cbor` vLLM's chain instead, block_hash.py):

    B       block size in tokens (default 16); only FULL blocks have a hash
    h_{-1}  = xxh64(salt.encode("utf-8"), seed=0).intdigest()            # salt "" -> xxh64(b"")
    h_i     = xxh64(h_{i-1}.to_bytes(8, "little")                        # 8 bytes
                    + token_ids[i*B:(i+1)*B] packed as int32 little-endian,  # 4*B bytes
                    seed=0).intdigest()                                  # unsigned 64-bit int

Block i's hash therefore covers every token before it and the salt, so equal hashes mean
equal prefixes of the same cache namespace. The salt is `cache_salt_for_api_key(key)`
(radixserve/api/api_keys.py)
(or "" for the shared namespace), chosen by the server, never by the client. Under a LoRA
adapter the salt is `salt + "\x00lora:" + adapter name` (lora/namespace.py's
routing_namespace; the event's `lora_name` names the adapter too).

Wire format (one JSON object per SSE `data:` line):
    {"seq": 7, "events": [
        {"type": "BlockStored", "block_hashes": [..], "parent_block_hash": int | null,
         "token_ids": [..], "block_size": 16, "medium": "CPU"},
        {"type": "BlockRemoved", "block_hashes": [..], "medium": "CPU"},
        {"type": "AllBlocksCleared"}]}

`medium` says where the blocks are, as vLLM's events do: "GPU" / "CPU" for the KV pool (the
device it is on), "LOCAL_DISK" for the local tier (--kv-offload-dir), "SHARED" for the tier
replicas share (--kv-shared-dir); null (older replicas) means the pool. A block may be in
several media at once; a removal names the medium it left.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Union

import numpy as np
import orjson
import xxhash

from radixserve.config.kv_events_config import HashAlgo
from radixserve.kv_events.block_hash import sha256_cbor_hashes
from radixserve.lora.namespace import routing_namespace, split_namespace

DEFAULT_BLOCK_SIZE = 16
_HASH_SEED = 0

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_LOCAL_DISK = "LOCAL_DISK"
MEDIUM_SHARED = "SHARED"
POOL_MEDIUMS = frozenset({None, MEDIUM_GPU, MEDIUM_CPU})


def is_pool_medium(medium: str | None) -> bool:
    return medium in POOL_MEDIUMS


def chained_hashes(chunks: Iterable[bytes], salt: str = "", parent: int | None = None
                   ) -> list[int]:
    """h_{-1} = xxh64(salt); h_i = xxh64(h_{i-1} as 8 bytes LE + chunk_i); seed 0 throughout.
    `parent`: the hash of the block before the first chunk (the chain continues from it)."""
    prev = (xxhash.xxh64_intdigest(salt.encode("utf-8"), seed=_HASH_SEED) if parent is None
            else parent)
    out: list[int] = []
    for chunk in chunks:
        prev = xxhash.xxh64_intdigest(prev.to_bytes(8, "little") + chunk, seed=_HASH_SEED)
        out.append(prev)
    return out


def block_hashes(
    token_ids: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE, salt: str = "",
    algo: HashAlgo = HashAlgo.XXH64,
) -> list[int]:
    """Hashes of the full blocks of `token_ids` (see the module docstring for the exact chain;
    `algo` sha256_cbor: vLLM's, block_hash.py).

    Raises ValueError for a block size < 1 and OverflowError for ids outside int32.
    """
    if algo is HashAlgo.SHA256_CBOR:
        return sha256_cbor_hashes(token_ids, block_size, salt)
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    num_blocks = len(token_ids) // block_size
    packed = np.asarray(token_ids[: num_blocks * block_size], dtype="<i4").tobytes()
    step = 4 * block_size
    return chained_hashes((packed[i * step : (i + 1) * step] for i in range(num_blocks)), salt)


@dataclass(frozen=True)
class BlockStored:
    """Consecutive full blocks newly cached; `parent_block_hash` is the block before the first."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]  # the tokens of these blocks, len == block_size * len(hashes)
    block_size: int
    # The tier holding the blocks ("GPU", "CPU", ...); None: the pool's own (the ZMQ
    # publisher names it). Not part of the SSE wire format.
    medium: str | None = None
    lora_name: str | None = None  # the LoRA adapter the blocks were computed under


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: tuple[int, ...]
    medium: str | None = None  # as BlockStored.medium


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


BlockEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True)
class EventBatch:
    """The block events of one publish call (one engine step), numbered 1, 2, 3, ..."""

    seq: int
    events: tuple[BlockEvent, ...]


class KVEventDecodeError(ValueError):
    """A `/kv_events` payload that is not a valid EventBatch."""


def encode_batch(batch: EventBatch) -> bytes:
    events: list[dict[str, Any]] = []
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            events.append({
                "type": "BlockStored", "block_hashes": list(ev.block_hashes),
                "parent_block_hash": ev.parent_block_hash, "token_ids": list(ev.token_ids),
                "block_size": ev.block_size, "medium": ev.medium,
                **({} if ev.lora_name is None else {"lora_name": ev.lora_name}),
            })
        elif isinstance(ev, BlockRemoved):
            events.append({"type": "BlockRemoved", "block_hashes": list(ev.block_hashes),
                           "medium": ev.medium})
        else:
            events.append({"type": "AllBlocksCleared"})
    return orjson.dumps({"seq": batch.seq, "events": events})


def decode_batch(data: bytes | str) -> EventBatch:
    """Parse one wire batch; raises KVEventDecodeError on anything malformed."""
    try:
        obj = orjson.loads(data)
        events: list[BlockEvent] = []
        for ev in obj["events"]:
            kind = ev["type"]
            if kind == "BlockStored":
                events.append(BlockStored(
                    tuple(int(h) for h in ev["block_hashes"]),
                    None if ev["parent_block_hash"] is None else int(ev["parent_block_hash"]),
                    tuple(int(t) for t in ev["token_ids"]), int(ev["block_size"]),
                    _medium(ev), ev.get("lora_name"),
                ))
            elif kind == "BlockRemoved":
                events.append(BlockRemoved(tuple(int(h) for h in ev["block_hashes"]),
                                           _medium(ev)))
            elif kind == "AllBlocksCleared":
                events.append(AllBlocksCleared())
            else:
                raise KVEventDecodeError(f"unknown event type {kind!r}")
        return EventBatch(int(obj["seq"]), tuple(events))
    except KVEventDecodeError:
        raise
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise KVEventDecodeError(f"malformed kv event batch: {e}") from e


def _medium(ev: dict[str, Any]) -> str | None:
    medium = ev.get("medium")
    if medium is not None and not isinstance(medium, str):
        raise KVEventDecodeError(f"medium must be a string or null, got {medium!r}")
    return medium


def _kind_name(kind: Any) -> str:
    return str(getattr(kind, "value", kind))  # a str or an Enum of strs


class KVEventPublisher:
    """Turns radix-cache events into numbered block-event batches and keeps a replay buffer.

    Lives in the API process's event loop: call `publish` from the loop thread (from another
    thread use `loop.call_soon_threadsafe(publisher.publish, events)`). It also keeps the set of
    block hashes currently cached, so that a subscriber too far behind the bounded buffer (or
    from a previous life of this replica) gets a snapshot instead of a gap.
    """

    def __init__(
        self, block_size: int = DEFAULT_BLOCK_SIZE, max_batches: int = 4096,
        keepalive_s: float = 10.0, hash_algo: HashAlgo = HashAlgo.XXH64,
    ) -> None:
        if block_size < 1 or max_batches < 1 or keepalive_s <= 0:
            raise ValueError("block_size and max_batches must be >= 1, keepalive_s > 0")
        self.block_size = block_size
        self.keepalive_s = keepalive_s
        self.hash_algo = hash_algo
        self._buffer: deque[EventBatch] = deque(maxlen=max_batches)
        self._live: dict[str | None, set[int]] = {}  # medium -> block hashes held there
        self._last_seq = 0
        self._wakeup: asyncio.Event | None = None
        self._closed = False
        # Called with each new batch, in order, from publish's thread (the ZMQ publisher).
        self.listeners: list[Callable[[EventBatch], object]] = []

    @property
    def last_seq(self) -> int:
        return self._last_seq

    @property
    def closed(self) -> bool:
        return self._closed

    def publish(self, cache_events: Iterable[Any]) -> EventBatch | None:
        """Convert radix-cache events and append them as one batch; None if no block changed.

        "stored": the full blocks whose end lies past prefix_len (the insert completed them);
        "removed": the full blocks with any token at or past prefix_len (they lost a token);
        "cleared": everything. A trailing partial block is never announced.
        """
        events: list[BlockEvent] = []
        for ce in cache_events:
            events.extend(self._convert(ce))
        return self.publish_blocks(events)

    def publish_blocks(self, events: Sequence[BlockEvent]) -> EventBatch | None:
        """Append already block-level events (for callers that hash blocks themselves)."""
        kept: list[BlockEvent] = []
        for ev in events:
            if isinstance(ev, BlockStored):
                self._live.setdefault(ev.medium, set()).update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                # NOTE: only announce blocks that were announced; a removal of a never-stored
                # block (a partial one, or a duplicate removal) would only confuse subscribers.
                live = self._live.get(ev.medium, set())
                gone = tuple(h for h in ev.block_hashes if h in live)
                if not gone:
                    continue
                live.difference_update(gone)
                ev = BlockRemoved(gone, ev.medium)
            else:
                self._live.clear()
            kept.append(ev)
        if not kept:
            return None
        self._last_seq += 1
        batch = EventBatch(self._last_seq, tuple(kept))
        self._buffer.append(batch)
        self._wake()
        for listener in self.listeners:
            listener(batch)
        return batch

    def _convert(self, ce: Any) -> list[BlockEvent]:
        if isinstance(ce, (BlockStored, BlockRemoved, AllBlocksCleared)):
            return [ce]  # already block-level (the tiers' events)
        kind = _kind_name(ce.kind)
        if kind == "cleared":
            return [AllBlocksCleared()]
        bs = self.block_size
        path: Sequence[int] = ce.token_ids
        num_full = len(path) // bs
        first = ce.prefix_len // bs  # first block whose end > prefix_len
        if first >= num_full:
            return []
        # A LoRA namespace hashes as salt + adapter name (lora/namespace.py), as routers key it.
        salt, lora = split_namespace(ce.salt)
        hashes = block_hashes(path[: num_full * bs], bs, routing_namespace(salt, lora),
                              self.hash_algo)
        medium = getattr(ce, "medium", None)  # a tiered cache names the tier
        if kind == "stored":
            parent = hashes[first - 1] if first > 0 else None
            tokens = tuple(int(t) for t in path[first * bs : num_full * bs])
            return [BlockStored(tuple(hashes[first:]), parent, tokens, bs, medium, lora)]
        if kind == "removed":
            return [BlockRemoved(tuple(hashes[first:]), medium)]
        raise ValueError(f"unknown cache event kind {kind!r}")

    def snapshot(self) -> EventBatch:
        """Everything cached now, as `AllBlocksCleared` + one `BlockStored` without token ids
        per medium."""
        events: list[BlockEvent] = [AllBlocksCleared()]
        for medium, hashes in self._live.items():
            if hashes:
                events.append(BlockStored(tuple(hashes), None, (), self.block_size, medium))
        return EventBatch(self._last_seq, tuple(events))

    def batches_since(self, seq: int) -> list[EventBatch]:
        """The batches after `seq` (the last one the subscriber applied; 0 = from the start).

        If the buffer no longer reaches back to seq + 1, or `seq` is ahead of this publisher
        (the replica restarted), the answer is `[snapshot()]`, whose seq is `last_seq`.
        """
        if seq == self._last_seq:
            return []
        oldest = self._buffer[0].seq if self._buffer else self._last_seq + 1
        if seq > self._last_seq or seq + 1 < oldest:
            return [self.snapshot()]
        return list(itertools.islice(self._buffer, seq + 1 - oldest, None))

    async def wait_newer(self, seq: int, timeout: float) -> bool:
        """Wait until a batch after `seq` exists (True) or `timeout` passes / close() (False)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._last_seq <= seq and not self._closed:
            if self._wakeup is None:
                self._wakeup = asyncio.Event()
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            try:  # not wait_for: on 3.11 it can swallow a cancel arriving with the wake-up
                async with asyncio.timeout(remaining):
                    await self._wakeup.wait()
            except TimeoutError:
                return False
        return self._last_seq > seq

    def close(self) -> None:
        """End every stream (server shutdown): waiters return and handlers finish."""
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None
