"""The load-or-recompute choice: per request and per tier, from what this device measured.

Owns: each tier's measured load rate (bytes/s, a running average that trusts a new sample
more the older the last one is), the prefill cost model of this device, the probes that keep
measuring a tier the choice has turned away from, and the per-tier choice counters. Does not
know: stores, files, requests (kv_tiers.py asks with a hit's tokens and tiers).

Prefill model: a prefill step of n new tokens whose mean position is p costs
    seconds = c0 + a * n + b * n * p
(c0 the step's fixed cost, a the per-token work, b the attention term that grows with the
context), fitted by least squares over the engine's own step timings with exponential
forgetting. Recomputing tokens [s, e) of a request adds a * (e - s) + b * (e - s) * (s + e) / 2
to its prefill (the step's fixed cost is paid anyway: the request computes its suffix).
Loading them costs, per tier, its tokens' bytes over that tier's rate. The choice loads the
leading run of blocks that saves the most (host memory ahead of a slow shared directory is
loaded, the rest recomputed); nothing when nothing saves.

Never latched: a tier the choice skips is probed (loaded anyway) once every PROBE_S (or
PROBE_COST times its last load's length, if longer, up to PROBE_MAX_S), so a slow phase that
ended is seen within a minute; a
rate sample after a long gap outweighs the old average.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from radixserve.cache.radix_types import Tier

EMA = 0.2  # weight of a new sample when the last one is recent
HALF_LIFE_S = 2.0  # a sample this old weighs half against a new one
PROBE_S = 5.0  # a tier skipped by the choice is loaded anyway this often (measured again)
PROBE_COST = 10.0  # ... but no sooner than this many times its last load's seconds after it
PROBE_MAX_S = 30.0  # ... and never later than this (loads resume within a minute)
FORGET = 0.05  # prefill model: weight each step takes off the older ones
RIDGE = 1e-9  # keeps the 3x3 fit solvable when every step had the same shape
MIN_FIT_SAMPLES = 8  # prefill steps before the fixed cost is fitted apart from the per-token
MIN_SPREAD = 0.25  # ... and their sizes must vary this much (std / mean)


class Choice(enum.Enum):
    LOAD = "load"  # loading beats recomputing (or nothing is measured yet)
    PROBE = "probe"  # recomputing looked cheaper, but the tier is due for a measurement
    RECOMPUTE = "recompute"


class DecayingRate:
    """amount / seconds, averaged; the newest sample weighs max(EMA, 1 - 2^(-age/half-life))
    where age is the time since the previous sample. None until measured."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate: float | None = None
        self._clock = clock
        self._last = 0.0

    def add(self, amount: float, seconds: float, replace: bool = False) -> None:
        """`replace`: the sample is a probe's, taken because the average was in doubt; it
        stands alone rather than being blended with what it was sent to re-measure."""
        if amount <= 0 or seconds <= 0:
            return
        now = self._clock()
        r = amount / seconds
        if self.rate is None or replace:
            self.rate = r
        else:
            w = max(EMA, 1.0 - 0.5 ** ((now - self._last) / HALF_LIFE_S))
            self.rate = (1 - w) * self.rate + w * r
        self._last = now


class PrefillModel:
    """seconds = c0 + a * n + b * n * p, fitted with forgetting (see the module docstring)."""

    def __init__(self) -> None:
        self._xtx = np.zeros((3, 3))
        self._xty = np.zeros(3)
        self.num_samples = 0
        self.coef: tuple[float, float, float] | None = None  # (c0, a, b)

    def add(self, num_tokens: int, mean_pos: float, seconds: float) -> None:
        if num_tokens <= 0 or seconds <= 0:
            return
        x = np.array([1.0, num_tokens / 1e3, num_tokens * mean_pos / 1e6])  # scaled features
        self._xtx = (1 - FORGET) * self._xtx + np.outer(x, x)
        self._xty = (1 - FORGET) * self._xty + x * seconds
        self.num_samples += 1
        self._fit()

    def _fit(self) -> None:
        w, n_sum, nn_sum = self._xtx[0, 0], self._xtx[0, 1], self._xtx[1, 1]
        spread = nn_sum / w - (n_sum / w) ** 2  # weighted variance of the step sizes
        mean_per_token = float(self._xty[0] / n_sum) / 1e3  # sum(seconds) / sum(tokens)
        if self.num_samples < MIN_FIT_SAMPLES or spread < (MIN_SPREAD * n_sum / w) ** 2:
            # The fixed cost and the per-token cost cannot be told apart yet: charge the
            # whole step per token (an upper bound: it errs towards loading, which measures).
            self.coef = (0.0, mean_per_token, 0.0)
            return
        try:
            c0, a, b = np.linalg.solve(self._xtx + RIDGE * np.eye(3), self._xty)
        except np.linalg.LinAlgError:
            c0, a, b = 0.0, mean_per_token * 1e3, 0.0
        a, b = max(float(a) / 1e3, 0.0), max(float(b) / 1e6, 0.0)
        if a == 0.0 and b == 0.0 or not math.isfinite(a + b):  # degenerate: per-token mean
            a, b = mean_per_token, 0.0
        self.coef = (max(float(c0), 0.0), a, b)

    def seconds(self, start: int, end: int) -> float | None:
        """What recomputing tokens [start, end) adds to a prefill; None until measured."""
        if self.coef is None:
            return None
        _, a, b = self.coef
        n = end - start
        return a * n + b * n * (start + end) / 2

    @property
    def tokens_per_s(self) -> float | None:
        """The marginal rate at a 1k-token context (for /metrics and stats)."""
        cost = self.seconds(0, 1000)
        return None if not cost else 1000 / cost


@dataclass(frozen=True)
class Decision:
    choice: Choice
    num_blocks: int  # the leading blocks of the hit to load (0: recompute them all)


class LoadChoice:
    def __init__(self, tiers: Sequence[Tier], bytes_per_token: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.bytes_per_token = bytes_per_token
        self.rates = {t: DecayingRate(clock) for t in tiers}
        self.prefill = PrefillModel()
        self.counts = {t: dict.fromkeys((c.value for c in Choice), 0) for t in tiers}
        self._clock = clock
        self._last_load = dict.fromkeys(tiers, -math.inf)  # when each tier was last loaded
        self._probing: set[Tier] = set()  # tiers whose next measured load is a probe's
        self._last_seconds = dict.fromkeys(tiers, 0.0)  # how long that load took
        self.probe_s = PROBE_S

    def decide(self, start: int, block_ends: Sequence[int], tiers: Sequence[Tier]) -> Decision:
        """The choice for a hit whose block j ends at block_ends[j] and is read from tiers[j]
        (the first block starts at `start`, the pool match)."""
        best, best_saving = 0, 0.0
        load_s, unknown = 0.0, False
        for j, (end, tier) in enumerate(zip(block_ends, tiers, strict=True)):
            lo = start if j == 0 else block_ends[j - 1]
            rate = self.rates[tier].rate
            unknown = unknown or rate is None
            load_s += 0.0 if rate is None else (end - lo) * self.bytes_per_token / rate
            last = j + 1 == len(tiers) or tiers[j + 1] != tier
            recompute = self.prefill.seconds(start, end)
            if last and (unknown or recompute is None or recompute - load_s > best_saving):
                best = j + 1
                best_saving = math.inf if unknown or recompute is None else recompute - load_s
        if best:
            return self._note(Decision(Choice.LOAD, best), tiers)
        due = [t for t in dict.fromkeys(tiers) if self.probe_due_in(t) <= 0]
        if due:  # load the run of the tier due for a measurement
            n = next(j for j, t in enumerate(tiers) if t == due[0])
            n += next((k for k, t in enumerate(tiers[n:]) if t != due[0]), len(tiers) - n)
            return self._note(Decision(Choice.PROBE, n), tiers)
        return self._note(Decision(Choice.RECOMPUTE, 0), tiers)

    def _note(self, decision: Decision, tiers: Sequence[Tier]) -> Decision:
        for t in dict.fromkeys(tiers[: decision.num_blocks]):
            self.counts[t][decision.choice.value] += 1
            self._last_load[t] = self._clock()
            if decision.choice is Choice.PROBE:
                self._probing.add(t)
        for t in dict.fromkeys(tiers[decision.num_blocks:]):
            self.counts[t][Choice.RECOMPUTE.value] += 1
        return decision

    def probe_due_in(self, tier: Tier) -> float:
        """Seconds until `tier` may be probed: PROBE_S after its last load ended, or PROBE_COST
        times that load's length (a slow tier's probes stay a small share), at most
        PROBE_MAX_S."""
        wait = min(max(self.probe_s, PROBE_COST * self._last_seconds[tier]), PROBE_MAX_S)
        return self._last_load[tier] + wait - self._clock()

    def note_load(self, bytes_by_tier: dict[Tier, int], seconds_by_tier: dict[Tier, float]
                  ) -> None:
        for tier, nbytes in bytes_by_tier.items():
            seconds = seconds_by_tier.get(tier, 0.0)
            probed = tier in self._probing
            self._probing.discard(tier)
            self.rates[tier].add(nbytes, seconds, replace=probed)
            self._last_load[tier], self._last_seconds[tier] = self._clock(), seconds
