"""The load-or-recompute choice (cache/tiers/load_choice.py) on a fake clock: per tier (a fast
host run is loaded, a slow shared run after it recomputed), per request (the attention term
makes long contexts dearer to recompute), probes that keep measuring a tier the choice turned
away from, and a rate that follows the newest sample after a gap (never latched)."""

from __future__ import annotations

import pytest

from radixserve.cache.radix_types import Tier
from radixserve.cache.tiers.load_choice import (
    PROBE_S,
    Choice,
    DecayingRate,
    LoadChoice,
    PrefillModel,
)

PER_TOKEN = 1000  # bytes of KV per token


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def fitted(a: float, b: float, c0: float = 0.01) -> PrefillModel:
    """A prefill model fed exact step times of c0 + a n + b n p over varied shapes."""
    m = PrefillModel()
    for n in (16, 64, 128, 256, 512, 1024, 32, 300, 700, 2000):
        for p in (n / 2, n / 2 + 1000, n / 2 + 3000):
            m.add(n, p, c0 + a * n + b * n * p)
    return m


def test_the_prefill_model_recovers_fixed_per_token_and_attention_costs() -> None:
    m = fitted(a=2e-4, b=1e-7)
    assert m.coef is not None
    c0, a, b = m.coef
    assert c0 == pytest.approx(0.01, rel=1e-3) and a == pytest.approx(2e-4, rel=1e-3)
    assert b == pytest.approx(1e-7, rel=1e-3)
    # Recomputing the same 256 tokens deep in a long context costs more (attention term).
    assert m.seconds(4000, 4256) > 2 * m.seconds(0, 256)  # type: ignore[operator]
    few = PrefillModel()
    few.add(100, 50, 0.11)  # one step: fixed and per-token cost cannot be told apart yet
    assert few.coef == (0.0, pytest.approx(0.11 / 100), 0.0)


def test_per_tier_the_fast_run_loads_and_the_slow_run_is_recomputed() -> None:
    clock = Clock()
    choice = LoadChoice([Tier.LOCAL, Tier.SHARED], PER_TOKEN, clock)
    choice.prefill = fitted(a=1e-4, b=0.0)  # 10k tokens/s
    choice.rates[Tier.LOCAL].add(PER_TOKEN * 1e6, 1.0)  # 1M tokens/s: loading wins
    choice.rates[Tier.SHARED].add(PER_TOKEN * 1e3, 1.0)  # 1k tokens/s: recomputing wins
    ends = [16 * (j + 1) for j in range(8)]
    tiers = [Tier.LOCAL] * 4 + [Tier.SHARED] * 4
    choice._last_load[Tier.SHARED] = clock.now  # not due for a probe
    d = choice.decide(0, ends, tiers)
    assert (d.choice, d.num_blocks) == (Choice.LOAD, 4)
    assert choice.counts[Tier.LOCAL]["load"] == 1 and choice.counts[Tier.SHARED]["recompute"] == 1


def test_unmeasured_loads_slow_recomputes_and_probes_resume_loading() -> None:
    clock = Clock()
    choice = LoadChoice([Tier.LOCAL], PER_TOKEN, clock)
    ends, tiers = [256], [Tier.LOCAL]
    assert choice.decide(0, ends, tiers).choice is Choice.LOAD  # nothing measured: load
    choice.prefill = fitted(a=1e-4, b=0.0)
    choice.note_load({Tier.LOCAL: 256 * PER_TOKEN}, {Tier.LOCAL: 1.0})  # a slow load
    clock.now += 0.1
    assert choice.decide(0, ends, tiers).choice is Choice.RECOMPUTE
    # The slow phase ends; no load measures it until the probe is due: PROBE_S, or ten
    # times the last (slow) load's second, whichever is longer.
    assert choice.probe_due_in(Tier.LOCAL) == pytest.approx(max(PROBE_S, 10.0) - 0.1)
    clock.now += choice.probe_due_in(Tier.LOCAL) - 0.5
    assert choice.decide(0, ends, tiers).choice is Choice.RECOMPUTE
    clock.now += 0.5
    probe = choice.decide(0, ends, tiers)
    assert (probe.choice, probe.num_blocks) == (Choice.PROBE, 1)
    choice.note_load({Tier.LOCAL: 256 * PER_TOKEN}, {Tier.LOCAL: 0.001})  # fast again
    clock.now += 0.1
    assert choice.decide(0, ends, tiers).choice is Choice.LOAD
    assert choice.counts[Tier.LOCAL] == {"load": 2, "probe": 1, "recompute": 2}


def test_a_rate_follows_a_new_sample_more_the_longer_the_gap() -> None:
    clock = Clock()
    r = DecayingRate(clock)
    r.add(100, 1.0)
    clock.now += 0.01
    r.add(1000, 1.0)  # right after: weight EMA
    assert r.rate == pytest.approx(0.8 * 100 + 0.2 * 1000)
    clock.now += 60  # a minute later: the new sample is nearly all of it
    r.add(1000, 1.0)
    assert r.rate is not None and r.rate > 999


def test_a_probe_sample_replaces_the_average_it_was_sent_to_recheck() -> None:
    """The probe re-measures a tier the average has written off: blended with that average
    (a short gap weighs a new sample little) one fast probe would leave the tier skipped."""
    clock = Clock()
    choice = LoadChoice([Tier.LOCAL], PER_TOKEN, clock)
    ends, tiers = [256], [Tier.LOCAL]
    choice.prefill = fitted(a=1e-4, b=0.0)  # recomputing 256 tokens: ~26 ms
    choice.probe_s = 0.01
    choice.note_load({Tier.LOCAL: 1000}, {Tier.LOCAL: 0.01})  # a short, very slow load
    assert choice.decide(0, ends, tiers).choice is Choice.RECOMPUTE
    clock.now += choice.probe_due_in(Tier.LOCAL)  # 0.1 s later: a short gap
    assert choice.decide(0, ends, tiers).choice is Choice.PROBE
    choice.note_load({Tier.LOCAL: 256 * PER_TOKEN}, {Tier.LOCAL: 0.01})  # 10 ms: fast enough
    assert choice.rates[Tier.LOCAL].rate == pytest.approx(256 * PER_TOKEN / 0.01)
    clock.now += 0.001
    assert choice.decide(0, ends, tiers).choice is Choice.LOAD  # blended, it would recompute
    # An ordinary (not probed) sample is blended again, not taken alone.
    choice.note_load({Tier.LOCAL: 1000}, {Tier.LOCAL: 0.01})
    rate = choice.rates[Tier.LOCAL].rate
    assert rate is not None and rate > 256 * PER_TOKEN / 0.01 / 2
