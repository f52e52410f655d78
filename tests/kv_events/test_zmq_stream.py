"""vLLM's KV-event contract (--kv-events-config): the wire layout is checked, field by field,
against vLLM's published schema (vllm/distributed/kv_events.py: array-like tagged msgspec
structs, multipart (topic, seq, payload), a ROUTER replay socket), and a subscriber decoding
our stream rebuilds exactly the blocks the radix tree holds, after evictions, a flush and a
replay."""

from __future__ import annotations

import random
import time
from pathlib import Path

import msgspec
import pytest

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
from tests.kv_events.random_inserts import RandomInserts
from tests.kv_events.zmq_subscriber import CONFIG, DECODER, Subscriber, local_config, sync

pytestmark = pytest.mark.timeout(60)


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
    zpub = ZmqKVEventPublisher(local_config(CONFIG), lambda: "CPU")
    sub = Subscriber(zpub.endpoint, str(zpub.replay_endpoint), "kv-events")
    try:
        pub.listeners.append(zpub.publish)
        sync(pub, sub)
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
        cleared = msgspec.msgpack.decode(sub.replay(0)[0][1])  # _synced's first batch
        assert cleared[1] == [["AllBlocksCleared"]]
        assert sub.topics == {b"kv-events"} and seq == pub.last_seq - 1
        assert sub.blocks == {hashes[0]}
    finally:
        sub.close()
        zpub.close()


@pytest.mark.parametrize("page_size", [1, 4])
def test_replay_rebuilds_the_radix_trees_blocks(page_size: int) -> None:
    from radixserve.cache.radix_cache import RadixCache

    pub = KVEventPublisher(block_size=4)
    zpub = ZmqKVEventPublisher(local_config(CONFIG), lambda: "CPU")
    sub = Subscriber(zpub.endpoint, str(zpub.replay_endpoint), "kv-events")
    pub.listeners.append(zpub.publish)
    cache = RadixCache(page_size=page_size, on_event=lambda ev: pub.publish([ev]))
    rng = random.Random(page_size)
    inserts = RandomInserts(cache, page_size, rng)
    kinds: set[str] = set()
    try:
        sync(pub, sub)
        for step in range(400):
            op = rng.random()
            if step == 250:
                cache.reset()  # what /flush_cache does; the rest rebuilds after it
                kinds.add("flush")
            elif op < 0.6:
                inserts.insert()
                kinds.add("insert")
            else:
                kinds.add("evict" if cache.evict(rng.randrange(1, 10)) else "noop")
            if step % 50 == 0:
                sub.poll(0)  # follow live now and then
        expected = inserts.expected_blocks(4)
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
    zpub = ZmqKVEventPublisher(local_config(CONFIG), lambda: "CPU")
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
