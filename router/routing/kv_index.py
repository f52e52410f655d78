"""Precise mode: the block hashes each replica really holds, followed from its `/kv_events`.

Owns: per-worker sets of cached block hashes (exact, from the replica's own events), a short
lived "pending" set per worker (blocks of requests routed there whose events have not arrived
yet: a replica announces blocks when it inserts them, so without it a burst sharing a new
prefix would scatter), and the coroutine that follows one replica's SSE stream with replay on
reconnect. Does not know: policies, HTTP routing, how token ids are produced.

A worker whose stream is down is "not live": `match` answers None and the caller falls back to
the approximate index for it.

Tiers: an event's `medium` says where its blocks are. Blocks in the KV pool (medium null,
"GPU" or "CPU") are `blocks`; blocks only in a tier below it ("LOCAL_DISK", "SHARED") are
`tier_blocks`: the replica can load them instead of recomputing, which is worth less than a
pool hit and more than a miss, so `match` counts such a block TIER_HIT_WEIGHT.

Memory bound: each worker's set holds at most `max_blocks` hashes (a replica that announces
more than that, or whose removals were lost, costs no more): past it, the hashes stored or
matched longest ago are forgotten first (`num_dropped` counts them), which can only cost a cache hit.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, KeysView, Sequence
from dataclasses import dataclass, field

import aiohttp

from radixserve.kv_events.publisher import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventDecodeError,
    decode_batch,
    is_pool_medium,
)

log = logging.getLogger(__name__)

MAX_SSE_EVENT_BYTES = 64 << 20  # a snapshot of a huge cache is one event; beyond: a bad peer
TIER_HIT_WEIGHT = 0.5  # a block a replica holds only in a tier, against 1 for a pool block


@dataclass
class WorkerKV:
    blocks: dict[int, None] = field(default_factory=dict)  # use order: least recent first
    tier_blocks: dict[int, None] = field(default_factory=dict)  # in a tier below the pool
    pending: OrderedDict[int, float] = field(default_factory=OrderedDict)  # hash -> expiry
    last_seq: int = 0
    live: bool = False
    block_size_mismatch: bool = False
    num_batches: int = 0
    num_dropped: int = 0  # hashes forgotten to stay within max_blocks

    @property
    def hashes(self) -> KeysView[int]:
        """The block hashes this worker holds (a read-only set view)."""
        return self.blocks.keys()

    def store(self, block_hashes: Sequence[int], max_blocks: int, in_pool: bool = True
              ) -> None:
        where = self.blocks if in_pool else self.tier_blocks
        for h in block_hashes:
            where.pop(h, None)  # re-stored: now the newest
            where[h] = None
            if in_pool:
                self.pending.pop(h, None)
        excess = len(where) - max_blocks
        if excess > 0:
            for h in list(itertools.islice(where, excess)):
                del where[h]
            self.num_dropped += excess


class PreciseIndex:
    def __init__(
        self, block_size: int, pending_ttl_s: float,
        clock: Callable[[], float] = time.monotonic, max_blocks: int = 1 << 20,
    ) -> None:
        self.block_size = block_size
        self.pending_ttl_s = pending_ttl_s
        self.max_blocks = max_blocks
        self._clock = clock
        self._workers: dict[str, WorkerKV] = {}

    def add_worker(self, url: str) -> None:
        self._workers.setdefault(url, WorkerKV())

    def drop_worker(self, url: str) -> None:
        self._workers.pop(url, None)

    def state(self, url: str) -> WorkerKV | None:
        return self._workers.get(url)

    def is_live(self, url: str) -> bool:
        st = self._workers.get(url)
        return st is not None and st.live and not st.block_size_mismatch

    def set_live(self, url: str, live: bool) -> None:
        st = self._workers.get(url)
        if st is not None:
            st.live = live

    def match(self, token_hashes: Sequence[int], url: str) -> float | None:
        """Consecutive blocks from block 0 that `url` holds or was just sent, a block it holds
        only in a tier counting TIER_HIT_WEIGHT; None if not live."""
        if not self.is_live(url):
            return None
        st = self._workers[url]
        self._expire(st)
        n = 0.0
        for h in token_hashes:
            if h in st.blocks:
                del st.blocks[h]  # used: now the newest, the last the memory bound drops
                st.blocks[h] = None
            elif h in st.pending:
                pass
            elif h in st.tier_blocks:
                n += TIER_HIT_WEIGHT
                continue
            else:
                break
            n += 1
        return n

    def note_routed(self, token_hashes: Sequence[int], url: str) -> None:
        st = self._workers.get(url)
        if st is None:
            return
        expiry = self._clock() + self.pending_ttl_s
        for h in token_hashes:
            if h not in st.hashes:
                st.pending[h] = expiry
                st.pending.move_to_end(h)  # keeps the dict ordered by expiry
        self._expire(st)

    def _expire(self, st: WorkerKV) -> None:
        now = self._clock()
        while st.pending:
            h, expiry = next(iter(st.pending.items()))
            if expiry > now:
                break
            del st.pending[h]

    def apply(self, url: str, batch: EventBatch) -> None:
        """Apply one batch in stream order (a snapshot batch starts with AllBlocksCleared)."""
        st = self._workers.get(url)
        if st is None:
            return
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                if ev.block_size != self.block_size and not st.block_size_mismatch:
                    log.warning("%s announces block_size %d, the router hashes %d blocks: "
                                "using the approximate index for it", url, ev.block_size,
                                self.block_size)
                    st.block_size_mismatch = True
                st.store(ev.block_hashes, self.max_blocks, is_pool_medium(ev.medium))
            elif isinstance(ev, BlockRemoved):
                pool = is_pool_medium(ev.medium)
                for h in ev.block_hashes:
                    if pool:
                        st.blocks.pop(h, None)
                        st.pending.pop(h, None)
                    else:
                        st.tier_blocks.pop(h, None)
            elif isinstance(ev, AllBlocksCleared):
                st.blocks.clear()
                st.tier_blocks.clear()
                st.pending.clear()
        st.last_seq = batch.seq
        st.num_batches += 1


def split_sse(buf: bytearray) -> list[bytes]:
    """Pop every complete event's data payload (its `data:` lines joined) from `buf`."""
    payloads = []
    while (end := buf.find(b"\n\n")) >= 0:
        event = bytes(buf[:end])
        del buf[: end + 2]
        data = [ln[5:].lstrip(b" ") for ln in event.split(b"\n") if ln.startswith(b"data:")]
        if data:
            payloads.append(b"\n".join(data))
    return payloads


async def follow_kv_events(
    session: aiohttp.ClientSession, url: str, index: PreciseIndex, read_timeout_s: float,
    api_key: str | None = None,
) -> None:
    """Follow `url`/kv_events until cancelled; reconnect with `since=last_seq` to replay.

    `api_key`: the replicas' key (they guard /kv_events like any non-public route)."""
    headers = {} if api_key is None else {"Authorization": f"Bearer {api_key}"}
    backoff = 0.1
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=read_timeout_s,
                                    sock_read=read_timeout_s)
    while True:
        st = index.state(url)
        if st is None:
            return
        try:
            async with session.get(f"{url}/kv_events", params={"since": str(st.last_seq)},
                                   timeout=timeout, headers=headers) as resp:
                if resp.status == 401:
                    log.warning("%s/kv_events answered 401: give the router the replicas' key "
                                "(--replica-api-key)", url)
                if resp.status != 200:
                    raise aiohttp.ClientResponseError(resp.request_info, (), status=resp.status)
                index.set_live(url, True)
                backoff = 0.1
                buf = bytearray()
                async for chunk in resp.content.iter_any():
                    buf += chunk
                    for payload in split_sse(buf):
                        index.apply(url, decode_batch(payload))
                    if len(buf) > MAX_SSE_EVENT_BYTES:
                        raise KVEventDecodeError("kv event larger than the limit")
        except (aiohttp.ClientError, asyncio.TimeoutError, KVEventDecodeError) as e:
            log.info("kv_events stream of %s down: %r", url, e)
        finally:
            index.set_live(url, False)
        await asyncio.sleep(backoff)
        backoff = min(backoff * 2, 2.0)
