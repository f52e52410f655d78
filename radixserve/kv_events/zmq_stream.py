"""vLLM's KV-event contract: the replica's block events as msgpack over ZMQ, with replay.

Owns: the wire structs (vLLM's schema, written here), the conversion from our EventBatch, and
the publisher thread with its PUB and ROUTER sockets. Does not know: where batches come from
(it listens to the KVEventPublisher that also feeds the SSE /kv_events, so both carry the
same block-hash chain, see kv_events.py), HTTP, the engine.

Wire format (what llm-d's kv-cache indexer and Dynamo's router decode):
  - each payload is msgpack of `EventBatch(ts, events, data_parallel_rank)`, an array-like
    struct: `[ts: float, [event, ...], dp_rank: int]`;
  - each event is an array-like struct tagged with its class name first:
      ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]
      ["BlockRemoved", block_hashes, medium]
      ["AllBlocksCleared"]
    block hashes are unsigned 64-bit ints; `medium` is the tier ("GPU", "CPU", ...);
  - PUB frames: (topic, seq as 8 bytes big-endian, payload); seq counts batches from 0;
  - replay: a DEALER/REQ sends (empty delimiter,) start seq as 8 bytes big-endian to the
    ROUTER socket; it answers one (b"", seq, payload) per buffered batch with seq >= start,
    then (b"", -1 as 8 signed bytes, b"") to end.
The last `buffer_steps` batches are kept for replay (older ones are gone, as in vLLM).

Threads: `publish` (the event loop's thread) only enqueues; one daemon thread owns both
sockets (ZMQ sockets are not thread-safe), encodes, sends and answers replay requests.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Union

import msgspec
import zmq

from radixserve.config import KVEventsConfig
from radixserve.kv_events.publisher import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventPublisher,
)
from radixserve.lora.namespace import lora_int_id

log = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
_POLL_S = 0.05  # the thread's longest wait, so replay requests are answered promptly


class KVEventsBindError(OSError):
    """An endpoint of --kv-events-config cannot be bound or connected (port taken, bad host)."""


class _Event(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class WireBlockStored(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class WireBlockRemoved(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class WireAllBlocksCleared(_Event, tag="AllBlocksCleared"):
    pass


WireEvent = Union[WireBlockStored, WireBlockRemoved, WireAllBlocksCleared]


class WireEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[WireEvent]
    data_parallel_rank: int | None = None


def to_wire(batch: EventBatch, medium: str, ts: float, dp_rank: int = 0) -> WireEventBatch:
    """Our batch in vLLM's structs; events without a medium get `medium`."""
    events: list[WireEvent] = []
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            events.append(WireBlockStored(list(ev.block_hashes), ev.parent_block_hash,
                                          list(ev.token_ids), ev.block_size,
                                          None if ev.lora_name is None
                                          else lora_int_id(ev.lora_name),
                                          ev.medium or medium))
        elif isinstance(ev, BlockRemoved):
            events.append(WireBlockRemoved(list(ev.block_hashes), ev.medium or medium))
        elif isinstance(ev, AllBlocksCleared):
            events.append(WireAllBlocksCleared())
    return WireEventBatch(ts, events, dp_rank)


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host or port, ipc:// or inproc:// binds; else connect."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqKVEventPublisher:
    def __init__(self, cfg: KVEventsConfig, medium: Callable[[], str],
                 dp_rank: int = 0) -> None:
        """Binds (or connects) now: a taken port fails here, at start-up. `medium()` names
        the pool's tier ("GPU" on CUDA, "CPU" otherwise) for events that carry none."""
        self.cfg = cfg
        self._medium = medium
        self._dp_rank = dp_rank
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(cfg.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self._topic = cfg.topic.encode("utf-8")
        # Its own context, not the process's shared one: close() terminates it, which returns
        # only once its I/O thread has closed the listening sockets, so the ports are free
        # when close() returns (a socket's close alone hands that to the I/O thread, later).
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._replay: zmq.Socket[bytes] | None = None
        try:
            if binds(cfg.endpoint):
                self._pub.bind(cfg.endpoint)
            else:
                self._pub.connect(cfg.endpoint)
            if cfg.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(cfg.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise KVEventsBindError(f"kv-events-config: cannot open {cfg.endpoint} / "
                                    f"{cfg.replay_endpoint}: {e}") from e
        self.num_dropped = 0  # batches refused because the queue was full
        self.num_sent = 0
        self._thread = threading.Thread(target=self._run, daemon=True, name="kv-events-zmq")
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """Where PUB is bound (the real port when the endpoint asked for `*`)."""
        return str(self._pub.getsockopt_string(zmq.LAST_ENDPOINT) or self.cfg.endpoint)

    @property
    def replay_endpoint(self) -> str | None:
        if self._replay is None:
            return None
        return str(self._replay.getsockopt_string(zmq.LAST_ENDPOINT))

    def publish(self, batch: EventBatch) -> None:
        """Queue one batch (a KVEventPublisher listener); never blocks the event loop."""
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1  # subscribers see the gap in seq and can replay

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (within `timeout`), then close the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._answer_replay()
            try:
                batch = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if batch is None:
                return
            wire = to_wire(batch, self._medium(), time.time(), self._dp_rank)
            payload = encoder.encode(wire)
            try:
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            except zmq.ZMQError as e:  # kept for replay: a subscriber can still get it
                log.warning("kv events: ZMQ send of batch %d failed: %r", seq, e)
            self._buffer.append((seq, payload))
            self.num_sent += 1
            seq += 1

    def _answer_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events: malformed replay request (%d frames)", len(frames))
            return
        identity, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((identity, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", END_OF_REPLAY, b""))


def medium_for_device(device: str | None) -> str:
    """vLLM names the GPU pool "GPU"; our CPU pool is "CPU"."""
    return "GPU" if (device or "").startswith("cuda") else "CPU"


def zmq_lifecycle(publisher: KVEventPublisher, cfg: KVEventsConfig,
                  device: Callable[[], str | None]
                  ) -> Callable[[object], AsyncIterator[None]]:
    """An aiohttp cleanup_ctx: bind when the server starts, listen to `publisher`'s
    batches, close on exit. `device()` is the engine's device once it has loaded."""

    async def lifecycle(_: object) -> AsyncIterator[None]:
        zmq_pub = ZmqKVEventPublisher(cfg, lambda: medium_for_device(device()))
        publisher.listeners.append(zmq_pub.publish)
        log.info("kv events: vLLM format on %s (replay: %s, topic %r)", zmq_pub.endpoint,
                 zmq_pub.replay_endpoint or "off", cfg.topic)
        try:
            yield
        finally:
            publisher.listeners.remove(zmq_pub.publish)
            zmq_pub.close()

    return lifecycle


class OfflineKVEvents:
    """The offline `LLM(kv_events_config=...)`: the engine's cache events, drained after each
    step, published as on a server (same hashes, same wire format). Close to free the ports."""

    def __init__(self, cfg: KVEventsConfig, device: str) -> None:
        self.blocks = KVEventPublisher()
        self.zmq = ZmqKVEventPublisher(cfg, lambda: medium_for_device(device))
        self.blocks.listeners.append(self.zmq.publish)

    def feed(self, cache_events: Sequence[object]) -> None:
        if cache_events:
            self.blocks.publish(cache_events)

    def close(self) -> None:
        self.zmq.close()
