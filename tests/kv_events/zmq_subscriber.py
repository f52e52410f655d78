"""A ZMQ KV-event subscriber for the tests, rebuilding the live block set from our stream.

It follows PUB in seq order and replays gaps, as a consumer (llm-d, Dynamo) would.

Owns: the issue's --kv-events-config on free loopback ports, the Subscriber, and syncing
it to a publisher. Does not know: radix caches, what a test asserts.
"""

from __future__ import annotations

import msgspec
import zmq

from radixserve.cli import parse_kv_events_config
from radixserve.config import KVEventsConfig
from radixserve.kv_events.publisher import AllBlocksCleared, KVEventPublisher
from radixserve.kv_events.zmq_stream import WireBlockRemoved, WireBlockStored, WireEventBatch

# The subscriber decodes with the module's own structs; what keeps them vLLM's is
# test_wire_layout_is_vllms_array_like_tagged_structs, which reads the raw msgpack
# positionally (field order, tags, array layout) as vLLM's schema lays it out.
DECODER = msgspec.msgpack.Decoder(type=WireEventBatch)
CONFIG = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", ' \
         '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}'


class Subscriber:
    """Follows PUB, applies batches in seq order, and asks the replay socket for gaps."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.blocks: set[int] = set()
        self.next_seq: int | None = None
        self.topics: set[bytes] = set()
        self.media: set[str | None] = set()
        self.num_replays = 0

    def close(self) -> None:
        self.sub.close(linger=0)

    def apply(self, batch: WireEventBatch) -> None:
        assert batch.data_parallel_rank == 0 and batch.ts > 0
        for ev in batch.events:
            if isinstance(ev, WireBlockStored):
                assert len(ev.token_ids) == ev.block_size * len(ev.block_hashes)
                assert ev.lora_id is None
                self.media.add(ev.medium)
                self.blocks.update(ev.block_hashes)
            elif isinstance(ev, WireBlockRemoved):
                self.media.add(ev.medium)
                self.blocks.difference_update(ev.block_hashes)
            else:
                self.blocks.clear()

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        """The (seq, payload) frames the replay socket sends for `start` (end marker off)."""
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            out: list[tuple[int, bytes]] = []
            while True:
                assert dealer.poll(10_000), "no replay answer"
                empty, seq, payload = dealer.recv_multipart()
                assert empty == b""
                n = int.from_bytes(seq, "big", signed=True)
                if n == -1:
                    assert payload == b""
                    return out
                out.append((n, payload))
        finally:
            dealer.close(linger=0)

    def poll(self, timeout_ms: int) -> bool:
        """Take one message if one comes; on a gap, replay what was missed first."""
        if not self.sub.poll(timeout_ms):
            return False
        topic, seq_bytes, payload = self.sub.recv_multipart()
        self.topics.add(topic)
        seq = int.from_bytes(seq_bytes, "big")
        if self.next_seq is not None and seq > self.next_seq:
            self.num_replays += 1
            for n, missed in self.replay(self.next_seq):
                if n < seq:
                    self.apply(DECODER.decode(missed))
        if self.next_seq is None or seq >= self.next_seq:
            self.apply(DECODER.decode(payload))
            self.next_seq = seq + 1
        return True


def local_config(cfg_json: str) -> KVEventsConfig:
    """The issue's config with the endpoints moved to free ports on 127.0.0.1."""
    cfg = parse_kv_events_config(cfg_json)
    return KVEventsConfig(**{**cfg.__dict__, "endpoint": "tcp://127.0.0.1:*",
                             "replay_endpoint": "tcp://127.0.0.1:*"})


def sync(pub: KVEventPublisher, sub: Subscriber) -> None:
    """PUB drops what it sends before the subscription reaches it: send AllBlocksCleared
    (a no-op on an empty cache) until one arrives."""
    for _ in range(200):
        pub.publish_blocks([AllBlocksCleared()])
        if sub.poll(50):
            while sub.poll(50):
                pass
            return
    raise AssertionError("the subscriber never received anything")
