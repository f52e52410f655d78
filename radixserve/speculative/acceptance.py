"""Verification and adaptivity: kept draft tokens, the next draft's length, the gate.

Which drafted tokens are kept, how long the next draft is, and whether drafting pays at all
for this batch.

Owns: accept_prefix (the acceptance rule), DraftLength (per request: the draft length from its
recent acceptance, and a backoff that switches drafting off for a request that keeps missing),
and DraftGate (per batch size: measured output tokens per second of steps with and without
drafts; drafting stays off where it is slower, e.g. a compute-bound large batch on CPU, and is
re-probed now and then). Does not know: tensors, the tree, requests' lifetimes.

The acceptance rule is speculative (rejection) sampling for a draft that is a point mass q = 1
on token d: accept d with probability min(1, p(d) / q(d)) = p(d); on rejection sample from the
residual max(0, p - q), i.e. p without d, renormalized. The sampler realizes it by drawing the
target token x ~ p at every drafted position (with the same per-position seeded generator a
non-speculative step uses) and accepting d exactly when x == d: P(accept) = p(d), and a
rejected position emits x, distributed as p conditioned on x != d, the residual. So the output
distribution is unchanged, and a seeded request yields the same tokens with speculation on or
off. Greedy is the limit case: x = argmax p.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

ACCEPTED_AVERAGE_WEIGHT = 0.5  # the newest step's weight in a request's accepted fraction
OFF_BELOW = 0.25  # a request's mean accepted fraction below this: drafting backs off
MAX_BACKOFF = 64  # steps a request may go undrafted before it probes again
MAX_EMPTY_SKIP = 8  # steps skipped at most after searches that found nothing
GATE_AVERAGE_WEIGHT = 0.2  # the newest step's weight in a batch bucket's tokens/s
PROBE_EVERY = 16  # the slower arm of a batch bucket is tried again this often
MIN_SAMPLES = 4  # steps of each arm before the gate trusts its averages
# Drafting is kept only where its steps give clearly more than plain ones. A tie is a loss:
# drafts put a batch's requests out of step, so it drains through small, inefficient batches
# at the end, and their extra tokens take compute a prefill could use. Measured on a 2-core
# CPU: batch 32 drafted 314-385 vs plain 281-381 tok/s per step (a tie inside the noise), yet
# 3-8% slower over the shared-prefix workload; a 10% margin still let noise switch it on.
ON_MARGIN = 1.2


def accept_prefix(draft: Sequence[int], targets: Sequence[int]) -> int:
    """Leading draft tokens equal to the target tokens at their positions.

    targets[j] is the token the target model chose after the sequence extended by
    draft[:j]; len(targets) == len(draft) + 1. The request keeps targets[: result + 1]."""
    assert len(targets) == len(draft) + 1, (len(draft), len(targets))
    n = 0
    for d, t in zip(draft, targets, strict=False):
        if d != t:
            break
        n += 1
    return n


def running_average(average: float, value: float, weight: float) -> float:
    """An exponential moving average's update: `weight` is the newest value's share."""
    return (1 - weight) * average + weight * value


@dataclass
class DraftLength:
    """One request's adaptive draft length (owned through its SpecState)."""

    max_len: int
    mean_accepted: float = 1.0  # fraction of drafted tokens accepted, smoothed
    backoff: int = 0  # current backoff length in steps (0: drafting on)
    skip: int = 0  # steps left before the next probe
    empty_streak: int = 0  # consecutive steps whose sources found nothing to draft

    def next_len(self) -> int:
        """The draft length to ask for this step (0: do not draft; counts a skipped step)."""
        if self.skip > 0:
            self.skip -= 1
            return 0
        return max(1, min(self.max_len, round(self.mean_accepted * self.max_len) + 1))

    def observe_empty(self) -> None:
        """The sources found no draft: look again less often while that lasts (a search is
        cheap, but at a large batch of unpredictable requests it would add up)."""
        self.empty_streak += 1
        self.skip = min(MAX_EMPTY_SKIP, self.empty_streak // 2)

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        self.empty_streak = 0
        rate = num_accepted / num_drafted
        self.mean_accepted = running_average(self.mean_accepted, rate, ACCEPTED_AVERAGE_WEIGHT)
        if self.mean_accepted < OFF_BELOW:
            self.backoff = min(MAX_BACKOFF, max(2, self.backoff * 2))
            self.skip = self.backoff
        elif rate > 0:
            self.backoff = 0


@dataclass
class _Arm:
    rate: float = 0.0  # output tokens per second, smoothed
    samples: int = 0

    def observe(self, tokens: int, seconds: float) -> None:
        value = tokens / max(seconds, 1e-9)
        self.rate = value if self.samples == 0 else running_average(self.rate, value,
                                                                     GATE_AVERAGE_WEIGHT)
        self.samples += 1


class DraftGate:
    """Per batch-size bucket (powers of two): draft only where steps with drafts have given
    more output tokens per second than steps without. Both arms are measured while learning;
    after that the losing arm is probed every PROBE_EVERY steps of its bucket."""

    def __init__(self) -> None:
        self._arms: dict[int, tuple[_Arm, _Arm]] = {}  # bucket -> (plain, drafted)
        self._steps: dict[int, int] = {}

    @staticmethod
    def bucket(batch_size: int) -> int:
        return max(1, batch_size).bit_length()

    def allow(self, batch_size: int) -> bool:
        b = self.bucket(batch_size)
        plain, drafted = self._arms.setdefault(b, (_Arm(), _Arm()))
        step = self._steps[b] = self._steps.get(b, 0) + 1
        # Learning: plain steps first, as a batch that drains (requests finishing) moves to
        # smaller, less efficient sizes within a bucket, which would flatter the arm measured
        # first; measuring the plain arm first errs toward not drafting.
        if plain.samples < MIN_SAMPLES:
            return False
        if drafted.samples < MIN_SAMPLES:
            return True
        better = drafted.rate >= ON_MARGIN * plain.rate
        return better != (step % PROBE_EVERY == 0)

    def observe(self, batch_size: int, drafted: bool, tokens: int, seconds: float) -> None:
        """One decode step's result: `tokens` output tokens in `seconds`."""
        arms = self._arms.setdefault(self.bucket(batch_size), (_Arm(), _Arm()))
        arms[1 if drafted else 0].observe(tokens, seconds)

    def snapshot(self) -> dict[int, tuple[float, float]]:
        return {b: (p.rate, d.rate) for b, (p, d) in self._arms.items()}
