"""`--prefix-caching-hash-algo sha256_cbor` (radixserve/kv_events/block_hash.py): both event
streams (SSE /kv_events and vLLM's ZMQ) carry vLLM's block hashes, equal to vectors made with
vLLM's own function (shared/vectors/vllm_block_hashes.json, copied beside this file), and the router's precise mode
routes by them."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from radixserve.cache.radix_types import CacheEvent, CacheEventKind
from radixserve.cli import build_config, build_parser
from radixserve.config import ConfigError, EngineConfig, ServerConfig
from radixserve.config.kv_events_config import HashAlgo
from radixserve.ipc.client import EngineClient
from radixserve.kv_events.block_hash import (
    NONE_HASH,
    sha256_cbor_digests,
    sha256_cbor_hashes,
)
from radixserve.kv_events.publisher import (
    BlockStored,
    KVEventPublisher,
    block_hashes,
    decode_batch,
    encode_batch,
)
from radixserve.kv_events.zmq_stream import WireBlockStored, ZmqKVEventPublisher
from radixserve.server.app import create_app as create_server_app
from radixserve.server.app_state import STATE_KEY
from radixserve.testing.fake_engine import FakeEngine, InlineTransport
from radixserve.testing.fake_replica import FakeReplicaConfig, fake_cluster, start_app
from router.app import ROUTER_KEY
from router.config import RouterConfig
from tests.kv_events.zmq_subscriber import CONFIG, DECODER, Subscriber, local_config, sync
from tests.tiny_models import make_tokenizer
from tests.waiting import wait_until

pytestmark = pytest.mark.timeout(60)

# A copy of shared/vectors/vllm_block_hashes.json (made with vLLM's own hash function).
VECTORS = Path(__file__).with_name("vllm_block_hashes.json")


def vectors() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(VECTORS.read_text())
    return data


def test_the_chain_is_vllms() -> None:
    data = vectors()
    assert NONE_HASH.hex() == data["none_hash_hex"]
    for case in data["cases"]:
        digests = sha256_cbor_digests(case["token_ids"], case["block_size"])
        assert [d.hex() for d in digests] == case["block_hashes_hex"]
        assert sha256_cbor_hashes(case["token_ids"], case["block_size"]) == \
            case["block_hashes_int64"]
    # A cache salt is vLLM's extra key of the first block: every hash after it differs.
    ids = data["cases"][1]["token_ids"]
    assert not set(sha256_cbor_hashes(ids, 16, "tenant")) & set(sha256_cbor_hashes(ids, 16))
    assert block_hashes(ids, 16) != sha256_cbor_hashes(ids, 16)  # xxh64 stays the default


def test_both_event_streams_carry_vllms_hashes() -> None:
    pub = KVEventPublisher(hash_algo=HashAlgo.SHA256_CBOR)
    zpub = ZmqKVEventPublisher(local_config(CONFIG), lambda: "CPU")
    sub = Subscriber(zpub.endpoint, str(zpub.replay_endpoint), "kv-events")
    try:
        pub.listeners.append(zpub.publish)
        sync(pub, sub)
        for case in vectors()["cases"]:
            stored = CacheEvent(CacheEventKind.STORED, tuple(case["token_ids"]), 0, "")
            batch = pub.publish([stored])
            assert batch is not None
            (sse,) = decode_batch(encode_batch(batch)).events  # the /kv_events wire
            assert isinstance(sse, BlockStored)
            assert list(sse.block_hashes) == case["block_hashes_int64"]
            while sub.next_seq != pub.last_seq:
                assert sub.poll(5000)
            seq, payload = sub.replay(pub.last_seq - 1)[0]
            (zmq_event,) = DECODER.decode(payload).events
            assert isinstance(zmq_event, WireBlockStored)
            assert zmq_event.block_hashes == case["block_hashes_int64"]
            assert zmq_event.parent_block_hash is None
            pub.publish([CacheEvent(CacheEventKind.CLEARED, (), 0, "")])
    finally:
        sub.close()
        zpub.close()


def test_serve_flag() -> None:
    args = build_parser().parse_args(["serve", "--prefix-caching-hash-algo", "sha256_cbor"])
    assert build_config(args, {}).prefix_caching_hash_algo == "sha256_cbor"
    assert build_config(build_parser().parse_args(["serve"]), {}).prefix_caching_hash_algo \
        == "xxh64"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--prefix-caching-hash-algo", "md5"])
    with pytest.raises(ConfigError):
        ServerConfig(prefix_caching_hash_algo="md5")


@pytest.mark.parametrize("algo", list(HashAlgo))
async def test_precise_routing_works_with_either_hash(algo: HashAlgo) -> None:
    prompt = "q" * 64  # 64 byte tokens: 4 blocks of 16
    cfg = RouterConfig(kv_events=True, health_interval_s=0.05, kv_stream_timeout_s=2.0,
                       prefix_caching_hash_algo=algo)
    rcfg = [FakeReplicaConfig(name=f"r{i}", hash_algo=algo) for i in range(2)]
    async with fake_cluster(cfg, rcfg) as c, aiohttp.ClientSession() as s:
        precise = c.router_app[ROUTER_KEY].precise
        assert precise is not None
        r0, r1 = c.replicas
        await wait_until(lambda: precise.is_live(r0.url) and precise.is_live(r1.url))
        want = set(block_hashes(list(prompt.encode()), 16, "", algo))
        async with s.post(f"{r1.url}/v1/completions", json={"prompt": prompt}) as resp:
            assert resp.status == 200  # sent to r1 directly: only its events tell the router
        st = precise.state(r1.url)
        await wait_until(lambda: st is not None and want <= st.hashes)
        for _ in range(3):
            async with s.post(f"{c.url}/v1/completions", json={"prompt": prompt}) as resp:
                assert resp.headers["X-Fake-Replica"] == "r1"


async def test_a_server_started_with_the_flag_announces_vllms_hashes(tmp_path: Path) -> None:
    """The real server app (fake engine) with prefix_caching_hash_algo=sha256_cbor: its SSE
    /kv_events stream carries vLLM's chain."""
    make_tokenizer().save_pretrained(tmp_path)
    cfg = ServerConfig(prefix_caching_hash_algo="sha256_cbor",
                       engine=EngineConfig(model=str(tmp_path), enable_kv_events=True))
    factory = functools.partial(FakeEngine, eos_token_ids=())
    app = create_server_app(cfg, EngineClient(InlineTransport(factory, cfg.engine)))
    runner, url = await start_app(app)
    ids = list(range(40, 80))  # 2 full blocks of 16
    stored: list[int] = []
    try:
        await wait_until(lambda: app[STATE_KEY].ready)
        async with aiohttp.ClientSession() as s:
            async with s.post(f"{url}/generate", json={
                    "input_ids": ids, "sampling_params": {"max_new_tokens": 2}}) as resp:
                assert resp.status == 200, await resp.text()
            async with s.get(f"{url}/kv_events?since=0") as resp:
                async for line in resp.content:
                    if line.startswith(b"data: "):
                        batch = decode_batch(line[6:].strip())
                        stored += [h for ev in batch.events if isinstance(ev, BlockStored)
                                   for h in ev.block_hashes]
                    if len(stored) >= 2:
                        break
    finally:
        await runner.cleanup()
    assert stored[:2] == sha256_cbor_hashes(ids, 16)
