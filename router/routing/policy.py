"""Routing policies: pure functions of plain data (candidates with load and prefix match).

Owns: the choice among healthy workers. Does not know: HTTP, the prefix index, health checks
(the caller passes only routable workers, each with its in-flight count and its match ratio:
the fraction of this request's prefix blocks the worker is believed to hold).

cache_aware rule (defaults: balance_lambda = 0.5):

    score(w) = match_ratio(w) - lambda * (load(w) - min_load) / max(1, mean_load)

  - nobody matches (every ratio 0): the least-loaded worker (ties rotate). Never "the smallest
    tree": that piles every miss onto one worker (SGLang router #14305).
  - otherwise the best score; ties prefer the longer match, then the lower load, then rotate.

  The load term is relative (divided by the mean), so the rule is scale-free: a worker holding
  the whole prefix (ratio 1) keeps winning until its load exceeds the least loaded one's by
  2 x the mean load; with 4 workers that is up to ~5x the least loaded one's load. Past that,
  the request goes to a lightly loaded worker, which then holds the prefix too: hot prefixes
  replicate to more workers while cold ones keep their affinity.

Load dead band (`balance_abs_threshold`, SGLang's flag of that name): while the candidates'
loads differ by at most that many requests, they count as equal, so the prefix match alone
decides and misses go by the tie-break. Each of several routers knows only its own in-flight
requests: without the band those differences split their choices under concurrency.

Ties (several routers, RouterConfig.router_replicas > 1): `choose(..., tie_key=k)` breaks
them by rendezvous hashing of (k, url) instead of a per-process rotation, so routers that
see the same candidates pick the same worker without talking to each other.
"""

from __future__ import annotations

import enum
import hashlib
import random
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from router.config import PolicyName, RouterConfig


class Candidate(NamedTuple):
    url: str
    in_flight: int
    match_ratio: float = 0.0  # in [0, 1]


class ChoiceReason(enum.Enum):
    PREFIX = "prefix"  # cache_aware: the best-matching worker won
    BALANCE = "balance"  # cache_aware: a match existed but load sent the request elsewhere
    MISS = "miss"  # cache_aware: no worker matched; least loaded
    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"
    RANDOM = "random"
    SESSION = "session"  # cache_aware: the session's replica (session.py), or its spill
    RESPONSE = "response"  # the replica holding the chain's previous response (any policy)


class Choice(NamedTuple):
    url: str
    reason: ChoiceReason


class Policy(Protocol):
    uses_prefix: bool  # whether the caller should compute match ratios at all

    def choose(self, candidates: Sequence[Candidate], tie_key: int | None = None) -> Choice:
        """Pick one of `candidates` (precondition: not empty). May advance internal counters.
        `tie_key`: break ties by hashing it with each tied url (module docstring)."""
        ...


def rendezvous(tie_key: int, tied: Sequence[Candidate]) -> Candidate:
    """The tied candidate whose hash with `tie_key` is highest: the same in every process."""
    def weight(c: Candidate) -> bytes:
        return hashlib.blake2b(f"{tie_key}|{c.url}".encode(), digest_size=8).digest()

    return max(tied, key=weight)


class _Rotor:
    """Breaks ties by rotation, so equal workers share sequential requests evenly."""

    def __init__(self) -> None:
        self._turn = 0

    def pick(self, tied: Sequence[Candidate], tie_key: int | None = None) -> Candidate:
        if tie_key is not None and len(tied) > 1:
            return rendezvous(tie_key, tied)
        chosen = tied[self._turn % len(tied)]
        self._turn += 1
        return chosen


class RoundRobinPolicy:
    uses_prefix = False

    def __init__(self) -> None:
        self._rotor = _Rotor()

    def choose(self, candidates: Sequence[Candidate], tie_key: int | None = None) -> Choice:
        assert candidates, "choose() needs at least one candidate"
        return Choice(self._rotor.pick(candidates).url, ChoiceReason.ROUND_ROBIN)


class LeastLoadPolicy:
    uses_prefix = False

    def __init__(self) -> None:
        self._rotor = _Rotor()

    def choose(self, candidates: Sequence[Candidate], tie_key: int | None = None) -> Choice:
        assert candidates, "choose() needs at least one candidate"
        low = min(c.in_flight for c in candidates)
        tied = [c for c in candidates if c.in_flight == low]
        return Choice(self._rotor.pick(tied, tie_key).url, ChoiceReason.LEAST_LOAD)


class RandomPolicy:
    uses_prefix = False

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, candidates: Sequence[Candidate], tie_key: int | None = None) -> Choice:
        assert candidates, "choose() needs at least one candidate"
        return Choice(self._rng.choice(list(candidates)).url, ChoiceReason.RANDOM)


class CacheAwarePolicy:
    uses_prefix = True

    def __init__(self, balance_lambda: float = 0.5, balance_abs_threshold: int = 0) -> None:
        assert balance_lambda >= 0 and balance_abs_threshold >= 0
        self.balance_lambda = balance_lambda
        self.balance_abs_threshold = balance_abs_threshold
        self._least = LeastLoadPolicy()
        self._rotor = _Rotor()

    def score(self, c: Candidate, candidates: Sequence[Candidate]) -> float:
        loads = [x.in_flight for x in candidates]
        mean = sum(loads) / len(loads)
        return c.match_ratio - self.balance_lambda * (c.in_flight - min(loads)) / max(1.0, mean)

    def choose(self, candidates: Sequence[Candidate], tie_key: int | None = None) -> Choice:
        assert candidates, "choose() needs at least one candidate"
        loads = [c.in_flight for c in candidates]
        if max(loads) - min(loads) <= self.balance_abs_threshold:
            # Within the dead band loads count as equal: each router sees only its own
            # requests, so their small differences must not decide (several routers).
            candidates = [c._replace(in_flight=0) for c in candidates]
        best_match = max(c.match_ratio for c in candidates)
        if best_match <= 0.0:
            return Choice(self._least.choose(candidates, tie_key).url, ChoiceReason.MISS)
        ranked = {c: (self.score(c, candidates), c.match_ratio, -c.in_flight) for c in candidates}
        top = max(ranked.values())
        chosen = self._rotor.pick([c for c in candidates if ranked[c] == top], tie_key)
        reason = ChoiceReason.PREFIX if chosen.match_ratio == best_match else ChoiceReason.BALANCE
        return Choice(chosen.url, reason)


def make_policy(cfg: RouterConfig) -> Policy:
    if cfg.policy is PolicyName.CACHE_AWARE:
        return CacheAwarePolicy(cfg.balance_lambda, cfg.balance_abs_threshold)
    if cfg.policy is PolicyName.ROUND_ROBIN:
        return RoundRobinPolicy()
    if cfg.policy is PolicyName.LEAST_LOAD:
        return LeastLoadPolicy()
    return RandomPolicy(cfg.seed)
