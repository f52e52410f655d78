"""The tiered prefix cache inside the real engine (tiny model, fp32): greedy tokens identical
with tiers on and off, after a restart, and from another replica's shared blocks; the load
is cheaper than the recompute by the engine's own timings; tenants stay isolated across tiers;
every step keeps the page invariant (check_integrity)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from radixserve.cache.tiers import BlockStore, Tier
from tests.cache.tiers.engine_runs import make_llm, prompts, run, warm_choice


def test_tokens_identical_with_tiers_off_and_on(tier_model: Path, tmp_path: Path) -> None:
    batch = prompts(4, 300)
    again = batch + batch  # the second round was evicted from the pool by the first
    plain = make_llm(tier_model)
    base, base_cached = run(plain, again)
    assert base_cached[4] == 0  # without tiers: evicted by the later prompts, recomputed
    assert plain.engine.tiers is None and not plain.engine.timings  # no per-step tier work
    for policy in ("write_back", "write_through"):
        llm = make_llm(tier_model, kv_offload_dir=tmp_path / policy,
                       kv_offload_write_policy=policy)
        outs, cached = run(llm, again)
        assert outs == base
        assert all(c >= 288 for c in cached[4:]), cached  # 18 whole blocks of 299 from the tier
        stats = llm.kv_stats()["kv_offload"]
        assert stats["tiers"]["local"]["hit_tokens_total"] >= 2 * 288
        assert not stats["errors"]
        llm.close()


def test_a_warm_load_is_cheaper_than_the_cold_prefill(tier_model: Path, tmp_path: Path) -> None:
    llm = make_llm(tier_model, kv_offload_dir=tmp_path, kv_cache_tokens=2048)
    (prompt,) = prompts(1, 500)
    run(llm, [prompt])
    cold = llm.engine.timings[next(iter(llm.engine.timings))]
    assert llm.engine.flush_cache()  # demotes the pool into the local tier
    assert llm.kv_stats()["kv_cached_tokens"] == 0
    _, cached = run(llm, [prompt])
    warm = list(llm.engine.timings.values())[-1]
    assert cached == [496] and warm.load_tokens == 496
    # The engine's own figures: the load of 496 tokens took less than computing them did
    # (measured per token; bench/README.md has the ratio on this machine).
    assert warm.load_seconds / warm.load_tokens < cold.prefill_seconds / cold.prefill_tokens
    info = llm.kv_stats()["kv_offload"]
    assert info["load_bytes_per_s"] > 0 and info["prefill_tokens_per_s"] > 0
    llm.close()


def test_restart_serves_the_first_requests_from_the_local_tier(tier_model: Path,
                                                               tmp_path: Path) -> None:
    batch = prompts(3, 200, seed=1)
    with make_llm(tier_model, kv_offload_dir=tmp_path) as first:
        before, _ = run(first, batch)
    second = make_llm(tier_model, kv_offload_dir=tmp_path)
    after, cached = run(second, batch)
    assert after == before
    assert all(c >= 0.9 * 199 for c in cached), cached
    second.close()


def test_replica_b_serves_a_prefix_replica_a_computed(tier_model: Path, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    batch = prompts(2, 250, seed=2)
    a = make_llm(tier_model, kv_shared_dir=shared)
    b = make_llm(tier_model, kv_shared_dir=shared)  # started before A computed anything
    ref, _ = run(a, batch)
    assert a.engine.tiers is not None and a.engine.tiers.writer.flush()
    b_tiers = b.engine.tiers
    assert b_tiers is not None
    b_tiers.stores[Tier.SHARED].refresh()  # what B's writer thread does every second
    outs, cached = run(b, batch)
    assert outs == ref
    assert all(c >= 240 for c in cached), cached
    assert b.kv_stats()["kv_offload"]["tiers"]["shared"]["hit_tokens_total"] >= 480
    a.close()
    b.close()


def test_tenants_never_hit_each_others_blocks(tier_model: Path, tmp_path: Path) -> None:
    llm = make_llm(tier_model, kv_offload_dir=tmp_path / "local", kv_shared_dir=tmp_path / "sh")
    (prompt,) = prompts(1, 300, seed=3)
    run(llm, [prompt], salt="tenant-a")
    assert llm.engine.flush_cache()
    _, cached_b = run(llm, [prompt], salt="tenant-b")
    assert cached_b == [0]
    assert llm.engine.flush_cache()
    _, cached_a = run(llm, [prompt], salt="tenant-a")
    assert cached_a[0] >= 288
    llm.close()


@pytest.mark.parametrize("flag", ["kv_offload_dir", "kv_shared_dir"])
def test_tiers_need_the_radix_cache_and_block_aligned_pages(tier_model: Path, tmp_path: Path,
                                                            flag: str) -> None:
    from radixserve.config import ConfigError

    with pytest.raises(ConfigError, match="page_size must divide 16"):
        make_llm(tier_model, page_size=3, **{flag: tmp_path})
    with pytest.raises(ConfigError, match="disable-radix-cache"):
        make_llm(tier_model, disable_radix_cache=True, **{flag: tmp_path})


def test_the_local_tier_is_chosen_over_recompute_from_256_tokens(tier_model: Path,
                                                                 tmp_path: Path) -> None:
    """No bypass: the engine's own measurements choose to load prompts of 256+ tokens."""
    llm = make_llm(tier_model, kv_offload_dir=tmp_path, kv_cache_tokens=4096)
    batch = [p[:n] for p, n in zip(prompts(3, 500, seed=11), (256, 384, 500), strict=True)]
    warm_choice(llm, batch)
    tiers = llm.engine.tiers
    assert tiers is not None and tiers.choice.prefill.num_samples >= 8
    _, cached = run(llm, batch)
    assert cached == [256 - 16, 384 - 16, 496], cached  # whole blocks before the last token
    counts = tiers.choice.counts[Tier.LOCAL]
    assert counts["load"] >= 3 and counts["recompute"] == 0, counts
    llm.close()


def test_a_slow_phase_then_a_fast_phase_resumes_loading(tier_model: Path,
                                                         tmp_path: Path) -> None:
    """Every file operation of the local tier delayed (an injected store delay): after one
    slow load the engine recomputes; when the disk is fast again a probe measures it and
    loading resumes (the choice never latches off)."""
    llm = make_llm(tier_model, kv_offload_dir=tmp_path, kv_cache_tokens=4096)
    batch = prompts(4, 300, seed=12)
    warm_choice(llm, batch)
    tiers = llm.engine.tiers
    assert tiers is not None
    store = tiers.stores[Tier.LOCAL]
    assert isinstance(store, BlockStore)
    assert tiers.writer.flush()  # the demoted blocks are files, not pending writes
    tiers.choice.probe_s = 2.0  # the default (5 s) makes the test slow, not different
    store.files.delay_s = 0.05  # slow phase: 50 ms per file operation
    _, first = run(llm, batch[:1], check=False)  # nothing measured says load: measured slow
    _, slow = run(llm, batch[1:2], check=False)
    assert first == [288] and slow == [0], (first, slow)  # recomputed: cheaper than 18 reads
    store.files.delay_s = 0.0  # fast phase
    time.sleep(max(0.0, tiers.choice.probe_due_in(Tier.LOCAL)))
    # One after the other: a probe, then an ordinary load that reads the probe's measurement
    # (sent together, the second is decided while the probe is still in flight).
    _, probe = run(llm, batch[2:3])
    _, ordinary = run(llm, batch[3:4])
    assert probe + ordinary == [288, 288], (probe, ordinary)
    counts = tiers.choice.counts[Tier.LOCAL]
    assert counts["recompute"] >= 1 and counts["probe"] >= 1, counts
    llm.close()
