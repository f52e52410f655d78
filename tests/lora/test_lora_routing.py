"""LoRA and the fleet: the router keys adapter plus prefix (one adapter's prefix to one
replica, adapters never colliding), and a replica's KV events hash adapter blocks in the
namespace the router computes (xxh64 and vLLM's sha256_cbor, whose LoRA extra key is the
adapter's name in every block)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from radixserve.config.kv_events_config import HashAlgo
from radixserve.kv_events.publisher import BlockStored, KVEventPublisher
from radixserve.lora.namespace import lora_namespace
from radixserve.testing.fake_replica import ByteEncoder
from router.config import RouterConfig
from router.core import Router
from router.routing.route_key import Prompt, RequestKind, route_salts, token_chains

A, B = "http://a:1", "http://b:1"


def _route(router: Router, model: str | None, prompt: list[int]) -> str:
    body = {"prompt": prompt, **({} if model is None else {"model": model})}
    key = asyncio.run(router.route_key(RequestKind.COMPLETIONS, body, None))
    decision = router.choose(key)
    assert decision is not None
    router.record(key, decision)
    return decision.worker.url


def test_same_adapter_and_prefix_go_to_the_same_replica() -> None:
    router = Router(RouterConfig(workers=(A, B), kv_block_size=4), None)
    prefix = list(range(40))
    first = {m: _route(router, m, prefix + [1]) for m in ("sql", "chat", None)}
    for _ in range(3):
        for m in ("sql", "chat", None):
            assert _route(router, m, prefix + [2, 3]) == first[m]  # adapter + prefix sticks
    keys = {m: asyncio.run(router.route_key(RequestKind.COMPLETIONS, {"prompt": prefix,
                                                                     "model": m}, None))
            for m in ("sql", "chat")}
    assert not set(keys["sql"].approx_hashes) & set(keys["chat"].approx_hashes)


@pytest.mark.parametrize("algo", [HashAlgo.XXH64, HashAlgo.SHA256_CBOR])
def test_replica_events_match_the_routers_adapter_chain(algo: HashAlgo) -> None:
    prompt = list(range(64))
    publisher = KVEventPublisher(block_size=16, hash_algo=algo)
    ns = lora_namespace("", "sql", "digest-of-weights")  # the replica's radix namespace
    batch = publisher.publish([SimpleNamespace(kind="stored", token_ids=prompt, prefix_len=0,
                                               salt=ns)])
    assert batch is not None
    (stored,) = batch.events
    assert isinstance(stored, BlockStored) and stored.lora_name == "sql"
    salts, _ = route_salts("", "sql")
    chains = token_chains(Prompt(token_ids=prompt), salts, 16, ByteEncoder(), algo)
    assert chains[0] == stored.block_hashes  # the router's adapter chain: the replica's
    assert chains[1] != stored.block_hashes  # the base model's chain: another namespace
