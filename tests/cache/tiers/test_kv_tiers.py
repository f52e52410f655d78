"""The tree's tier state (offloaded nodes) and KVTiers over real block stores, without an
engine: demotion keeps evicted nodes in the tree, a pool insert replaces an offloaded copy,
tier evictions prune the tree, the probe continues the hash chain past the pool match, loads
put back exactly the bytes that were written, and a bad block stops a load as a miss."""

from __future__ import annotations

from array import array
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from radixserve.cache.radix_cache import RadixCache
from radixserve.cache.radix_types import Demotion
from radixserve.cache.tiers import MissReason, StoreStatus, Tier, block_key
from radixserve.cache.tiers.block_io import BLOCK, KVCodec
from radixserve.cache.tiers.kv_tiers import KVTiers, fingerprint
from radixserve.cache.tiers.tier_types import TierSettings
from radixserve.kv_events.publisher import BlockStored, block_hashes
from radixserve.server.metrics import ServerMetrics

LAYERS, SLOTS, HEADS, DIM = 2, 256, 2, 4


class RecordingHooks:
    """Demotes every evicted node to LOCAL with the keys of the blocks ending in it."""

    def __init__(self) -> None:
        self.inserted: list[tuple[int, int]] = []
        self.evicted: list[tuple[int, int]] = []

    def on_insert(self, tokens: array[int], slots: array[int], start: int, salt: str) -> None:
        self.inserted.append((start, len(tokens)))

    def on_evict(self, tokens: array[int], slots: array[int], start: int, salt: str
                 ) -> Demotion:
        self.evicted.append((start, len(tokens)))
        end = len(tokens) // BLOCK
        keys = tuple(f"{h:032x}" for h in block_hashes(tokens[: end * BLOCK], BLOCK, salt)
                     )[start // BLOCK:]
        return Demotion(Tier.LOCAL if keys else None, keys)


def test_evicted_nodes_stay_offloaded_and_a_pool_insert_replaces_them() -> None:
    hooks = RecordingHooks()
    cache = RadixCache(tiers=hooks)
    tokens = list(range(100, 148))  # 3 blocks
    cache.insert(tokens[:20], list(range(20)))
    cache.insert(tokens, list(range(48)))
    assert hooks.inserted == [(0, 20), (20, 48)]
    freed = cache.evict(48)
    assert sorted(freed) == list(range(48)) and cache.total_size == 0
    # The child [20, 48) owns blocks 1, 2 (ending at 32, 48); the parent [0, 20) block 0.
    assert hooks.evicted == [(20, 48), (0, 20)]
    assert cache.tier_tokens == {Tier.LOCAL: 48}
    cache.check_integrity()
    assert cache.match_prefix(tokens).cached_len == 0  # offloaded KV is not a pool match
    # A pool copy of the first 32 tokens replaces the offloaded nodes on its path.
    cache.insert(tokens[:32], list(range(100, 132)))
    assert cache.match_prefix(tokens).cached_len == 32
    assert cache.tier_tokens == {} and cache.total_size == 32
    cache.check_integrity()


def test_a_node_without_a_whole_block_is_dropped_and_tier_evictions_prune() -> None:
    hooks = RecordingHooks()
    cache = RadixCache(tiers=hooks)
    cache.insert(list(range(10)), list(range(10)))  # no block ends inside it
    cache.insert([7] * 32, list(range(10, 42)))
    cache.evict(100)
    assert cache.tier_tokens == {Tier.LOCAL: 32}
    keys = [f"{h:032x}" for h in block_hashes([7] * 32, BLOCK)]
    assert cache.prune_tier_keys(keys[1:]) == 32  # one block gone: the node goes
    assert cache.tier_tokens == {}
    cache.check_integrity()


def make_tiers(tmp_path: Path, policy: str = "write_back", shared: bool = True
               ) -> tuple[KVTiers, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    k = torch.randn(LAYERS, SLOTS, HEADS, DIM, generator=g)
    v = torch.randn(LAYERS, SLOTS, HEADS, DIM, generator=g)
    fp = fingerprint("tiny", torch.float32, LAYERS, HEADS, DIM)
    settings = TierSettings(tmp_path / "local", 1 << 20, tmp_path / "shared" if shared else None,
                            1 << 20, policy, durable=False)
    return KVTiers(settings, fp, KVCodec(k, v), emit_events=True), k, v


def test_write_back_demotes_and_a_load_restores_the_same_bytes(tmp_path: Path) -> None:
    tiers, k, v = make_tiers(tmp_path, shared=False)
    cache = RadixCache(tiers=tiers)
    tokens = list(range(1, 50))  # 3 full blocks + 1 token
    cache.insert(tokens, list(range(49)))
    assert tiers.writer.flush() and not tiers.stores[Tier.LOCAL].keys()  # nothing written yet
    cache.evict(49)
    assert tiers.writer.flush()
    assert not tiers.sync()
    assert len(tiers.stores[Tier.LOCAL].keys()) == 3
    hit = tiers.probe(tokens, "", 5)
    assert hit is not None and (hit.start, hit.end) == (5, 48)
    assert hit.tiers == (Tier.LOCAL,) * 3
    dest = list(range(100, 143))
    done = tiers.load(hit, dest).result()
    assert (done.num_blocks, done.num_tokens, done.miss) == (3, 43, None)
    assert torch.equal(k[:, 100:143], k[:, 5:48]) and torch.equal(v[:, 100:143], v[:, 5:48])
    assert tiers.probe(tokens, "tenant-b", 0) is None  # another salt: another chain
    events = tiers.take_events()
    assert all(isinstance(e, BlockStored) and e.medium == "LOCAL_DISK" for e in events)
    tiers.close()


def test_write_through_publishes_to_shared_and_a_corrupt_block_is_a_miss(tmp_path: Path
                                                                         ) -> None:
    tiers, k, _ = make_tiers(tmp_path, policy="write_through")
    cache = RadixCache(tiers=tiers)
    tokens = list(range(1, 33))
    cache.insert(tokens, list(range(32)))
    assert tiers.writer.flush()
    tiers.sync()
    fp = tiers.fp
    keys = [block_key(h, fp) for h in block_hashes(tokens, BLOCK)]
    for tier in (Tier.LOCAL, Tier.SHARED):
        assert sorted(tiers.stores[tier].keys()) == sorted(keys)
    # Corrupt block 1 in the local tier: the shared tier's good copy makes it good.
    flip_byte(tmp_path / "local" / f"{keys[1]}.kvb")
    hit = tiers.probe(tokens + [0], "", 0)
    assert hit is not None and hit.num_tokens == 32
    done = tiers.load(hit, list(range(200, 232))).result()
    assert (done.num_blocks, done.num_tokens, done.miss) == (2, 32, None)
    assert done.recovered == [(MissReason.CORRUPT, Tier.LOCAL)]
    assert done.tokens_by_tier == {Tier.LOCAL: 16, Tier.SHARED: 16}
    assert torch.equal(k[:, 200:232], k[:, 0:32])
    tiers.record_load(done)
    assert tiers.stats()["errors"].get("corrupt", 0) == 1  # the local miss still counts
    # The bad local copy is gone; corrupt the shared one too: the load takes block 0 and
    # stops there.
    flip_byte(tiers.stores[Tier.SHARED].path(keys[1]))  # type: ignore[attr-defined]
    hit = tiers.probe(tokens + [0], "", 0)
    assert hit is not None and hit.tiers == (Tier.LOCAL, Tier.SHARED)
    before = k[:, 100:132].clone()
    done = tiers.load(hit, list(range(100, 132))).result()
    assert (done.num_blocks, done.num_tokens, done.miss) == (1, 16, MissReason.CORRUPT)
    assert done.miss_tier == Tier.SHARED
    assert torch.equal(k[:, 100:116], k[:, 0:16])
    assert torch.equal(k[:, 116:132], before[:, 16:])  # the bad block wrote nothing
    tiers.record_load(done)
    assert tiers.stats()["errors"].get("corrupt", 0) == 2
    tiers.close()


def test_a_payload_of_another_size_is_read_from_the_other_tier_and_counted_once(
        tmp_path: Path) -> None:
    """A well-formed file whose payload has the wrong size (another layout): the store
    cannot tell, the loader can; the other tier's copy loads and the error counts once."""
    tiers, k, _ = make_tiers(tmp_path, policy="write_through")
    tokens = list(range(1, 17))
    RadixCache(tiers=tiers).insert(tokens, list(range(16)))
    assert tiers.writer.flush()
    tiers.sync()
    key = block_key(block_hashes(tokens, BLOCK)[0], tiers.fp)
    local = tiers.stores[Tier.LOCAL]
    local.delete(key)
    assert local.put(key, b"\0" * 64) is StoreStatus.STORED
    hit = tiers.probe(tokens + [0], "", 0)
    assert hit is not None and hit.tiers == (Tier.LOCAL,)
    done = tiers.load(hit, list(range(100, 116))).result()
    assert (done.num_blocks, done.miss, done.layout_errors) == (1, None, 1)
    assert done.recovered == [(MissReason.CORRUPT, Tier.LOCAL)]
    assert torch.equal(k[:, 100:116], k[:, 0:16])
    tiers.record_load(done)
    assert tiers.stats()["errors"].get("corrupt", 0) == 1
    tiers.close()


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-20] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_tree_and_tiers_integrity_after_eviction(tmp_path: Path, policy: str) -> None:
    tiers, _, _ = make_tiers(tmp_path, policy=policy)
    cache = RadixCache(tiers=tiers)
    for i in range(4):
        cache.insert([i] * 40, list(range(40 * i, 40 * i + 40)))
    cache.evict(160)
    assert tiers.writer.flush()
    cache.prune_tier_keys(tiers.sync())
    cache.check_integrity()
    tree_keys = {key: node.tier for key, node in cache._tier_keys.items()}
    assert len(tree_keys) == 8
    tiers.check_stores()
    tiers.check_tree(tree_keys)
    tiers.close()


def test_a_pool_insert_over_a_namespaces_only_offloaded_child_keeps_the_namespace() -> None:
    cache = RadixCache(tiers=RecordingHooks())
    cache.insert([5] * 32, list(range(32)), salt="a")
    cache.evict(32)
    cache.insert([5] * 32, list(range(32, 64)), salt="a")
    assert cache.match_prefix([5] * 32, salt="a").cached_len == 32
    cache.check_integrity()


def test_host_memory_layer_above_the_disk(tmp_path: Path) -> None:
    """The CUDA layout of the local tier (host memory above the disk), on plain memory here:
    the host layer holds one block, so the others are read back from the disk."""
    g = torch.Generator().manual_seed(1)
    k = torch.randn(LAYERS, SLOTS, HEADS, DIM, generator=g)
    v = torch.randn(LAYERS, SLOTS, HEADS, DIM, generator=g)
    fp = fingerprint("tiny", torch.float32, LAYERS, HEADS, DIM)
    codec = KVCodec(k, v)
    settings = TierSettings(tmp_path, 1 << 20, None, 0, "write_back",
                            host_bytes=codec.block_bytes, durable=False)
    tiers = KVTiers(settings, fp, codec)
    cache = RadixCache(tiers=tiers)
    tokens = list(range(1, 50))
    cache.insert(tokens, list(range(49)))
    cache.evict(49)
    assert tiers.writer.flush() and tiers.sync() == []  # host evictions lose nothing
    local = tiers.stores[Tier.LOCAL]
    assert len(local.keys()) == 3 and len(local.host.keys()) == 1  # type: ignore[attr-defined]
    hit = tiers.probe(tokens, "", 0)
    assert hit is not None and hit.num_tokens == 48
    done = tiers.load(hit, list(range(100, 148))).result()
    assert done.num_tokens == 48 and torch.equal(k[:, 100:148], k[:, 0:48])
    tiers.close()


def test_cli_flags_and_offline_keywords(tmp_path: Path) -> None:
    from radixserve.cli import build_config, build_parser
    from radixserve.config import ConfigError, EngineConfig

    args = build_parser().parse_args([
        "serve", "--kv-offload-dir", str(tmp_path / "l"), "--kv-offload-size", "2.5",
        "--kv-shared-dir", str(tmp_path / "s"), "--kv-shared-size", "0.5",
        "--kv-offload-shutdown-timeout", "12"])
    cfg = build_config(args, {}).engine
    assert (cfg.kv_shared_size, cfg.kv_offload_shutdown_timeout) == (0.5, 12.0)
    assert (cfg.kv_offload_dir, cfg.kv_offload_size, cfg.kv_shared_dir) == (
        str(tmp_path / "l"), 2.5, str(tmp_path / "s"))
    assert cfg.kv_offload_write_policy == "write_back" and cfg.kv_tiers_enabled
    default = build_config(build_parser().parse_args(["serve"]), {}).engine
    assert default.kv_offload_dir is None and default.kv_offload_size == 16.0
    assert not default.kv_tiers_enabled
    # LLM(..., kv_offload_dir=Path) reaches EngineConfig as these keywords (paths accepted).
    assert EngineConfig(kv_offload_dir=tmp_path).kv_offload_dir == str(tmp_path)
    assert (default.kv_shared_size, default.kv_offload_shutdown_timeout) == (16.0, 30.0)
    with pytest.raises(ConfigError, match="kv_offload_size"):
        EngineConfig(kv_offload_dir=tmp_path, kv_offload_size=0)
    with pytest.raises(ConfigError, match="kv_shared_size"):
        EngineConfig(kv_shared_dir=tmp_path, kv_shared_size=-1)
    with pytest.raises(ConfigError, match="kv_offload_shutdown_timeout"):
        EngineConfig(kv_offload_dir=tmp_path, kv_offload_shutdown_timeout=-1)
    with pytest.raises(ConfigError, match="different"):
        EngineConfig(kv_offload_dir=tmp_path, kv_shared_dir=tmp_path)


def test_metrics_name_the_tier_fault_counter_by_kind() -> None:
    stats = {"kv_offload": {"tiers": {"local": {"hit_tokens_total": 32, "stored_tokens": 64}},
                            "errors": {"corrupt": 2, "no_space": 1}}}
    text = ServerMetrics(lambda: stats).render().decode()
    assert 'radixserve:kv_offload_errors_total{kind="corrupt"} 2.0' in text
    assert 'radixserve:kv_offload_errors_total{kind="no_space"} 1.0' in text
    assert 'radixserve:kv_offload_hit_tokens_total{tier="local"} 32.0' in text
    assert 'radixserve:kv_offload_stored_tokens{tier="local"} 64.0' in text


def test_shutdown_writes_a_pool_larger_than_the_pending_cap_or_logs_the_dropped(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(LAYERS, SLOTS, HEADS, DIM, generator=g), torch.randn(
        LAYERS, SLOTS, HEADS, DIM, generator=g)
    codec = KVCodec(k, v)
    fp = fingerprint("tiny", torch.float32, LAYERS, HEADS, DIM)
    settings = TierSettings(tmp_path / "local", 1 << 20, None, 0, durable=False,
                            max_pending_bytes=2 * codec.block_bytes)  # 2 of the 12 blocks
    tiers = KVTiers(settings, fp, codec)
    cache = RadixCache(tiers=tiers)
    for i in range(4):
        cache.insert([i + 1] * 48, list(range(48 * i, 48 * i + 48)))
    with caplog.at_level("INFO"):
        assert tiers.persist(cache, timeout=30) == 0  # waited for room: nothing dropped
    assert "every pending block written in" in caplog.text
    assert len(tiers.stores[Tier.LOCAL].keys()) == 12
    tiers.close()
    slow = KVTiers(replace(settings, local_dir=tmp_path / "slow"), fp, codec)
    slow.stores[Tier.LOCAL].files.delay_s = 0.2  # type: ignore[attr-defined]
    cache = RadixCache(tiers=slow)
    for i in range(4):
        cache.insert([i + 1] * 48, list(range(48 * i, 48 * i + 48)))
    with caplog.at_level("WARNING"):
        dropped = slow.persist(cache, timeout=0.3)
    assert 0 < dropped <= 12 and f"{dropped} block writes not done" in caplog.text
    slow.stores[Tier.LOCAL].files.delay_s = 0.0  # type: ignore[attr-defined]
    slow.close()


def test_metrics_show_the_step_wait_histogram_and_the_choices_per_tier() -> None:
    stats = {"kv_offload": {
        "tiers": {"local": {"choices_total": {"load": 3, "probe": 1, "recompute": 2},
                            "load_bytes_per_s": 5e8}},
        "step_wait": {"buckets": [0.001, 0.01], "counts": [5, 2, 1], "sum": 0.05}}}
    text = ServerMetrics(lambda: stats).render().decode()
    assert 'radixserve:kv_offload_choices_total{choice="recompute",tier="local"} 2.0' in text
    assert 'radixserve:kv_offload_choices_total{choice="probe",tier="local"} 1.0' in text
    assert 'radixserve:kv_offload_tier_load_bytes_per_second{tier="local"} 5e+08' in text
    assert 'radixserve:kv_offload_step_wait_seconds_bucket{le="0.01"} 7.0' in text
    assert 'radixserve:kv_offload_step_wait_seconds_bucket{le="+Inf"} 8.0' in text
    assert "radixserve:kv_offload_step_wait_seconds_count 8.0" in text
