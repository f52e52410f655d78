"""vLLM's KV-event contract (--kv-events-config): a subscriber written from vLLM's published
schema (vllm/distributed/kv_events.py: array-like tagged msgspec structs, multipart
(topic, seq, payload), a ROUTER replay socket) decodes our stream, and replaying a workload
rebuilds exactly the blocks the radix tree holds, after evictions, a flush and a replay."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Union

import msgspec
import pytest
import zmq

from radixserve.cli import build_config, build_parser, parse_kv_events_config
from radixserve.config import ConfigError, KVEventsConfig
from radixserve.kv_events.publisher import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEventPublisher,
    block_hashes,
)
from radixserve.kv_events.zmq_stream import (
    KVEventsBindError,
    ZmqKVEventPublisher,
    binds,
    medium_for_device,
)

pytestmark = pytest.mark.timeout(60)


# --- vLLM's schema, as a consumer (llm-d, Dynamo) declares it -------------------------------
# Written here from vLLM's published schema, on purpose not imported from
# radixserve.kv_events.zmq_stream (whose Wire* structs look the same): an independent decoder is
# what catches a drift in field order, tags or array layout on our side.

class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events"""


class VBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None


class VAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[VBlockStored, VBlockRemoved, VAllBlocksCleared]]
    data_parallel_rank: int | None = None


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
CONFIG = '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557", ' \
         '"replay_endpoint": "tcp://*:5558", "topic": "kv-events"}'


class Subscriber:
    """Follows PUB, applies batches in seq order, and asks the replay socket for gaps."""

    def __init__(self, endpoint: str, replay_endpoint: str, topic: str) -> None:
        ctx = zmq.Context.instance()
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

    def apply(self, batch: KVEventBatch) -> None:
        assert batch.data_parallel_rank == 0 and batch.ts > 0
        for ev in batch.events:
            if isinstance(ev, VBlockStored):
                assert len(ev.token_ids) == ev.block_size * len(ev.block_hashes)
                assert ev.lora_id is None
                self.media.add(ev.medium)
                self.blocks.update(ev.block_hashes)
            elif isinstance(ev, VBlockRemoved):
                self.media.add(ev.medium)
                self.blocks.difference_update(ev.block_hashes)
            else:
                self.blocks.clear()

    def replay(self, start: int) -> list[tuple[int, bytes]]:
        """The (seq, payload) frames the replay socket sends for `start` (end marker off)."""
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            out = []
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


def _local(cfg_json: str) -> KVEventsConfig:
    """The issue's config with the endpoints moved to free ports on 127.0.0.1."""
    cfg = parse_kv_events_config(cfg_json)
    return KVEventsConfig(**{**cfg.__dict__, "endpoint": "tcp://127.0.0.1:*",
                             "replay_endpoint": "tcp://127.0.0.1:*"})


def _synced(pub: KVEventPublisher, sub: Subscriber) -> None:
    """PUB drops what it sends before the subscription reaches it: send AllBlocksCleared
    (a no-op on an empty cache) until one arrives."""
    for _ in range(200):
        pub.publish_blocks([AllBlocksCleared()])
        if sub.poll(50):
            while sub.poll(50):
                pass
            return
    raise AssertionError("the subscriber never received anything")


def test_config_parsing_and_cli() -> None:
    args = build_parser().parse_args(["serve", "--kv-events-config", CONFIG])
    cfg = build_config(args, {})
    assert cfg.kv_events_config == KVEventsConfig(True, "zmq", "tcp://*:5557", "tcp://*:5558",
                                                  topic="kv-events")
    assert cfg.engine.enable_kv_events and cfg.kv_events_config.publishes
    off = build_config(build_parser().parse_args(
        ["serve", "--kv-events-config", '{"enable_kv_cache_events": false}']), {})
    assert off.kv_events_config is not None and not off.kv_events_config.publishes
    assert not off.engine.enable_kv_events
    assert parse_kv_events_config('{"enable_kv_cache_events": true}').publisher_name == "zmq"
    plain = build_config(build_parser().parse_args(["serve"]), {})
    assert plain.kv_events_config is None and plain.metrics_compat is None
    for bad in ("nope", "[]", '{"enable_kv_cache_events": true, "publisher": "kafka"}',
                '{"enable_kv_cache_events": true, "endpoint": "http://x:1"}',
                '{"enable_kv_cache_events": "yes"}', '{"buffer_steps": 0}',
                '{"enable_kv_cache_events": true, "typo": 1}'):
        with pytest.raises(ConfigError):
            parse_kv_events_config(bad)
    assert binds("tcp://*:5557") and binds("ipc:///tmp/x") and not binds("tcp://10.0.0.1:5557")
    assert medium_for_device("cuda:0") == "GPU" and medium_for_device("cpu") == "CPU"


def test_wire_layout_is_vllms_array_like_tagged_structs() -> None:
    pub = KVEventPublisher(block_size=2)
    zpub = ZmqKVEventPublisher(_local(CONFIG), lambda: "CPU")
    sub = Subscriber(zpub.endpoint, str(zpub.replay_endpoint), "kv-events")
    try:
        pub.listeners.append(zpub.publish)
        _synced(pub, sub)
        hashes = block_hashes([5, 6, 7, 8], 2)
        # An explicit medium (a tier's) passes through; the removal names the medium the
        # block was stored in (the publisher tracks live blocks per medium).
        pub.publish_blocks([BlockStored(tuple(hashes), None, (5, 6, 7, 8), 2, "GPU"),
                            BlockRemoved((hashes[1],), "GPU")])
        while sub.next_seq != pub.last_seq:  # every batch is sent: ZMQ seq = batch seq - 1
            assert sub.poll(5000)
        seq, payload = sub.replay(pub.last_seq - 1)[0]
        raw = msgspec.msgpack.decode(payload)
        assert raw[1] == [["BlockStored", hashes, None, [5, 6, 7, 8], 2, None, "GPU"],
                          ["BlockRemoved", [hashes[1]], "GPU"]]
        assert isinstance(raw[0], float) and raw[2] == 0 and len(raw) == 3
        assert sub.topics == {b"kv-events"} and seq == pub.last_seq - 1
        assert sub.blocks == {hashes[0]}
    finally:
        sub.close()
        zpub.close()


@pytest.mark.parametrize("page_size", [1, 4])
def test_replay_rebuilds_the_radix_trees_blocks(page_size: int) -> None:
    from radixserve.cache.radix_cache import RadixCache

    pub = KVEventPublisher(block_size=4)
    zpub = ZmqKVEventPublisher(_local(CONFIG), lambda: "CPU")
    sub = Subscriber(zpub.endpoint, str(zpub.replay_endpoint), "kv-events")
    pub.listeners.append(zpub.publish)
    cache = RadixCache(page_size=page_size, on_event=lambda ev: pub.publish([ev]))
    rng = random.Random(page_size)
    inserted: list[tuple[tuple[int, ...], str]] = []
    next_slot = 0
    kinds: set[str] = set()
    try:
        _synced(pub, sub)
        for step in range(400):
            op = rng.random()
            if step == 250:
                cache.reset()  # what /flush_cache does; the rest rebuilds after it
                kinds.add("flush")
            elif op < 0.6:
                base = list(rng.choice(inserted)[0]) if inserted and rng.random() < 0.7 else []
                seq = tuple(base[: rng.randrange(len(base) + 1)]
                            + [rng.randrange(3) for _ in range(rng.randrange(1, 12))])
                salt = rng.choice(["", "k"])
                n = len(seq) - len(seq) % page_size
                cache.insert(seq[:n], list(range(next_slot, next_slot + n)), salt)
                next_slot += n
                inserted.append((seq, salt))
                kinds.add("insert")
            else:
                kinds.add("evict" if cache.evict(rng.randrange(1, 10)) else "noop")
            if step % 50 == 0:
                sub.poll(0)  # follow live now and then
        expected: set[int] = set()
        for seq, salt in inserted:
            cached_len = cache.match_prefix(seq, salt).cached_len
            expected.update(block_hashes(seq[:cached_len], 4, salt))
        assert {"insert", "evict", "flush"} <= kinds and expected
        deadline = time.monotonic() + 30
        while sub.next_seq != zpub.num_sent or zpub.num_sent < pub.last_seq:
            sub.poll(100)
            assert time.monotonic() < deadline, "the live stream did not catch up"
        assert sub.blocks == expected  # live (+ replay of any gap)
        assert sub.media == {"CPU"}
        # A late subscriber: replay from 0 alone rebuilds the same set.
        late = Subscriber(zpub.endpoint, str(zpub.replay_endpoint), "kv-events")
        frames = late.replay(0)
        late.close()
        assert [n for n, _ in frames] == list(range(zpub.num_sent))
        for _, payload in frames:
            late.apply(DECODER.decode(payload))
        assert late.blocks == expected == set(_live(pub))
        # Replay from the middle: exactly the batches from there on.
        assert [n for n, _ in sub.replay(7)] == list(range(7, zpub.num_sent))
    finally:
        sub.close()
        zpub.close()


def _live(pub: KVEventPublisher) -> list[int]:
    snap = pub.snapshot().events
    return list(snap[1].block_hashes) if len(snap) > 1 else []  # type: ignore[union-attr]


def test_publisher_close_is_prompt_and_frees_the_port() -> None:
    zpub = ZmqKVEventPublisher(_local(CONFIG), lambda: "CPU")
    replay = str(zpub.replay_endpoint)  # the ROUTER socket always binds
    for i in range(5):
        zpub.publish(EventBatch(i + 1, (AllBlocksCleared(),)))
    zpub.close()
    assert zpub.num_sent == 5
    cfg = KVEventsConfig(True, "zmq", "tcp://127.0.0.1:*", replay_endpoint=replay)
    again = ZmqKVEventPublisher(cfg, lambda: "CPU")  # the port is free again
    try:  # and now taken: a clear start-up error, nothing left open
        with pytest.raises(KVEventsBindError, match="cannot open"):
            ZmqKVEventPublisher(cfg, lambda: "CPU")
    finally:
        again.close()


def test_offline_llm_publishes_the_same_events(tiny_llama: Path) -> None:
    """`LLM(kv_events_config=...)`: the offline engine's blocks, as a server publishes them."""
    from radixserve import LLM, SamplingParams

    cfg = {**parse_kv_events_config(CONFIG).__dict__, "endpoint": "tcp://127.0.0.1:*",
           "replay_endpoint": "tcp://127.0.0.1:*"}
    llm = LLM(model=str(tiny_llama), dtype="float32", kv_cache_tokens=4096,
              kv_events_config=cfg)
    try:
        assert llm.kv_events is not None and llm.engine.cfg.enable_kv_events
        prompt = list(range(1, 50))
        outs = llm.generate([prompt, prompt[:40] + [7] * 9],
                            SamplingParams(max_tokens=3, temperature=0))
        zpub = llm.kv_events.zmq
        deadline = time.monotonic() + 10
        while zpub.num_sent < llm.kv_events.blocks.last_seq:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        sub = Subscriber(zpub.endpoint, str(zpub.replay_endpoint), "kv-events")
        for _, payload in sub.replay(0):
            sub.apply(DECODER.decode(payload))
        sub.close()
        assert sub.blocks == set(_live(llm.kv_events.blocks))
        assert set(block_hashes(prompt, 16)) <= sub.blocks  # the prompt's 3 full blocks
        assert all(o.finish_reason == "length" for o in outs)
        assert sub.media == {"CPU"}
    finally:
        llm.close()
    assert llm.kv_events is None
