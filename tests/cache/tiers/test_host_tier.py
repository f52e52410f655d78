"""Host memory is a tier of its own in the load-or-recompute choice (Tier.HOST): the local
tier's host layer and its disk each keep their load rate and choice counters, so a slow disk
never turns host-memory hits away and a slow host layer never turns disk hits away. KVTiers
over real stores on CPU (the host layer in plain memory), loads measured, no bypass; the
device's prefill speed is given to the cost model as the engine's step timings would be."""

from __future__ import annotations

from pathlib import Path

import torch

from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.tiers import BlockStore, HostStore, Tier
from radixserve.cache.tiers.block_io import KVCodec
from radixserve.cache.tiers.kv_tiers import KVTiers, fingerprint
from radixserve.cache.tiers.tier_types import TierHit, TierSettings
from radixserve.server.metrics import ServerMetrics

LAYERS, SLOTS, HEADS, DIM = 2, 256, 2, 4
DELAY_S = 0.1  # per file operation (disk) or per read (host layer): 0.3 s a 3-block load
HOT = [11] * 48  # three blocks, written last: held by the host layer (and the disk)
COLD = [7] * 48  # three blocks the host layer evicted: on the disk only


def host_and_disk(tmp_path: Path) -> tuple[KVTiers, HostStore, BlockStore]:
    """The host layer holds 3 blocks: after COLD then HOT are evicted, COLD is on disk only."""
    g = torch.Generator().manual_seed(5)
    k = torch.randn(LAYERS, SLOTS, HEADS, DIM, generator=g)
    v = torch.randn(LAYERS, SLOTS, HEADS, DIM, generator=g)
    codec = KVCodec(k, v)
    settings = TierSettings(tmp_path, 1 << 20, None, 0, host_bytes=3 * codec.block_bytes,
                            durable=False)
    tiers = KVTiers(settings, fingerprint("tiny", torch.float32, LAYERS, HEADS, DIM), codec)
    cache = RadixCache(tiers=tiers)
    cache.insert(COLD, list(range(48)))
    cache.evict(48)
    cache.insert(HOT, list(range(48, 96)))
    cache.evict(48)
    assert tiers.writer.flush() and tiers.sync() == []
    # The device: 1k prefill tokens/s, so recomputing 48 tokens costs ~48 ms: a 3-block load
    # slowed to 0.3 s costs more, an unslowed one (well under a millisecond) far less, with
    # room for a busy box to preempt it.
    for n in (16, 48, 96, 160, 256, 32, 64, 128, 200, 320):
        tiers.note_prefill(n, n / 2, 1e-3 + 1e-3 * n)
    host, disk = tiers.sources[Tier.HOST], tiers.sources[Tier.LOCAL]
    assert isinstance(host, HostStore) and isinstance(disk, BlockStore)
    return tiers, host, disk


def hit_of(tiers: KVTiers, tokens: list[int]) -> TierHit:
    hit = tiers.probe(tokens + [0], "", 0)  # the prompt: its history and one more token
    assert hit is not None and hit.num_tokens == 48
    return hit


def load_once(tiers: KVTiers, hit: TierHit) -> None:
    """The choice's first sight of a tier is a load (nothing measured): it measures it."""
    chosen = tiers.choose(hit)
    assert chosen is not None and chosen.num_tokens == 48
    tiers.record_load(tiers.load(chosen, list(range(100, 148))).result())


def test_a_slow_disk_does_not_turn_host_memory_hits_away(tmp_path: Path) -> None:
    tiers, _, disk = host_and_disk(tmp_path)
    hot, cold = hit_of(tiers, HOT), hit_of(tiers, COLD)
    assert hot.tiers == (Tier.HOST,) * 3 and cold.tiers == (Tier.LOCAL,) * 3
    load_once(tiers, hot)  # host memory: microseconds
    disk.files.delay_s = DELAY_S
    load_once(tiers, cold)  # 3 reads of 100 ms: slower than recomputing
    assert tiers.choose(cold) is None  # the disk's hits are recomputed ...
    chosen = tiers.choose(hot)  # ... host memory's still loaded
    assert chosen is not None and chosen.num_tokens == 48 and not chosen.probe
    counts = tiers.choice.counts
    assert counts[Tier.HOST] == {"load": 2, "probe": 0, "recompute": 0}, counts
    assert counts[Tier.LOCAL] == {"load": 1, "probe": 0, "recompute": 1}, counts
    rates = {t: r.rate for t, r in tiers.choice.rates.items()}
    assert rates[Tier.HOST] is not None and rates[Tier.LOCAL] is not None
    assert rates[Tier.HOST] > 10 * rates[Tier.LOCAL], rates
    text = ServerMetrics(lambda: {"kv_offload": tiers.stats()}).render().decode()
    assert 'radixserve:kv_offload_choices_total{choice="load",tier="host"} 2.0' in text
    assert 'radixserve:kv_offload_choices_total{choice="recompute",tier="local"} 1.0' in text
    assert 'radixserve:kv_offload_hit_tokens_total{tier="host"} 48.0' in text
    assert 'radixserve:kv_offload_hit_tokens_total{tier="local"} 48.0' in text
    assert 'radixserve:kv_offload_stored_tokens{tier="host"} 48.0' in text
    assert 'radixserve:kv_offload_stored_tokens{tier="local"} 96.0' in text
    disk.files.delay_s = 0.0
    tiers.close()


def test_a_slow_host_layer_does_not_turn_disk_hits_away(tmp_path: Path) -> None:
    tiers, host, _ = host_and_disk(tmp_path)
    hot, cold = hit_of(tiers, HOT), hit_of(tiers, COLD)
    load_once(tiers, cold)  # the disk, unslowed: well under a millisecond per block
    host.delay_s = DELAY_S
    load_once(tiers, hot)  # 3 host reads of 100 ms each
    assert tiers.choose(hot) is None
    chosen = tiers.choose(cold)
    assert chosen is not None and chosen.num_tokens == 48 and not chosen.probe
    counts = tiers.choice.counts
    assert counts[Tier.HOST] == {"load": 1, "probe": 0, "recompute": 1}, counts
    assert counts[Tier.LOCAL] == {"load": 2, "probe": 0, "recompute": 0}, counts
    host.delay_s = 0.0
    tiers.close()

