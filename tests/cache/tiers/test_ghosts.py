"""No ghost nodes: 10,000 requests through the radix cache and the real KVTiers over a store
that drops every write (the writer full) or fails every write; the tree stays as if the tiers
had never been tried: no offloaded node claims a block no tier holds, and the node count stays
within what the pool allows."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.radix_walk import iter_nodes
from radixserve.cache.tiers import StoreStatus, Tier
from radixserve.cache.tiers.block_io import KVCodec
from radixserve.cache.tiers.kv_tiers import KVTiers, fingerprint
from radixserve.cache.tiers.tier_types import TierSettings

POOL, LAYERS, HEADS, DIM = 512, 1, 1, 4
NUM_REQUESTS = 10_000


def tiers(tmp_path: Path, mode: str) -> KVTiers:
    k, v = torch.zeros(LAYERS, POOL, HEADS, DIM), torch.zeros(LAYERS, POOL, HEADS, DIM)
    settings = TierSettings(tmp_path / "local", 1 << 30, tmp_path / "shared", 1 << 30,
                            "write_back" if mode == "drop" else "write_through", durable=False,
                            max_pending_bytes=0 if mode == "drop" else 1 << 30)
    t = KVTiers(settings, fingerprint("ghost", torch.float32, LAYERS, HEADS, DIM), KVCodec(k, v))
    if mode == "fail":
        for store in t.stores.values():
            store.put = lambda key, payload: StoreStatus.ERROR  # type: ignore[method-assign]
    return t


def serve(cache: RadixCache, kv: KVTiers, free: list[int], rng: random.Random,
          sessions: list[list[int]]) -> None:
    """One request: a session's history plus new tokens, computed into pool slots and
    cached; the pool makes room by evicting (demoting) as the engine does."""
    s = rng.randrange(len(sessions))
    tokens = sessions[s] + [rng.randrange(1, 30000) for _ in range(rng.randrange(8, 48))]
    sessions[s] = tokens if len(tokens) < 300 else tokens[:32]
    match = cache.match_prefix(tokens)
    cache.lock(match.node)
    need = len(tokens) - match.cached_len
    if need > len(free):
        free.extend(cache.evict(need - len(free)))
    cache.unlock(match.node)
    new = [free.pop() for _ in range(need)]
    ins = cache.insert(tokens, match.slots + new)
    free.extend(new[: max(0, ins.num_already_cached - match.cached_len)])
    cache.prune_tier_keys(kv.sync())


@pytest.mark.parametrize("mode", ["drop", "fail"])
def test_no_ghost_nodes_after_10000_requests(tmp_path: Path, mode: str) -> None:
    kv = tiers(tmp_path, mode)
    cache = RadixCache(tiers=kv)
    rng = random.Random(0)
    sessions = [[rng.randrange(1, 30000) for _ in range(64)] for _ in range(40)]
    free = list(range(POOL))
    for i in range(NUM_REQUESTS):
        serve(cache, kv, free, rng, sessions)
        if i % 1000 == 0:
            assert kv.writer.flush()
            cache.prune_tier_keys(kv.sync())
            cache.check_integrity()
    assert kv.writer.flush()
    cache.prune_tier_keys(kv.sync())
    cache.check_integrity()
    nodes = list(iter_nodes([cache.root_for("")] if cache.root_for("") else []))
    # Every node holds pool tokens (each at least one slot): nothing offloaded is left.
    assert cache.tier_tokens == {} and not cache.tier_keys()
    assert len(nodes) <= POOL and cache.total_size + len(free) == POOL
    assert all(n.tier is Tier.POOL for n in nodes)
    errors = kv.stats()["errors"]
    assert errors.get("write_dropped" if mode == "drop" else "write_error", 0) > 100, errors
    kv.close()
