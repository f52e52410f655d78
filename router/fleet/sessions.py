"""Session affinity: keep a conversation on the replica that holds its cache, within a load bound.

Owns: a request's session id (first found: the `X-Session-Id` header, the body's
`prompt_cache_key`, `user`, `safety_identifier`), the table session -> the replica that last
served it (LRU, `max_sessions` entries), the bounded-load consistent-hash ring, and the
session counters. Does not know: HTTP, the prefix indexes, policies other than its own rule.

Rule (cache_aware only; the caller passes routable candidates with load and prefix match):
  - the session's last replica is a candidate:
      - it holds none of this prompt while another replica holds some (a restart, an
        eviction seen by precise mode): no pick here, the prefix policy decides (MOVED);
      - its load is within the bound: it serves (HIT);
      - else the request spills over (SPILL): the first replica within the bound walking the
        ring clockwise from the session's hash. The table keeps the last replica, so the
        session comes back once the burst is over.
  - no last replica (new session, or it left the pool): a prefix match anywhere lets the
    prefix policy decide; with none, the ring walk picks (NEW / MOVED). The ring makes two
    routers put a new session on the same replica without sharing state.
Bound (Mirrokni, Thorup, Zadimoghaddam, "Consistent Hashing with Bounded Loads"): with m
requests in flight over n replicas, a replica may take the new one while its load is below
ceil(c * (m + 1) / n), c = `load_factor` >= 1. Some replica always is (the loads sum to m), so
the walk always ends, and no replica holds more than c times the mean: a burst of one session
cannot pin a replica while others starve.
"""

from __future__ import annotations

import bisect
import enum
import hashlib
import math
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

from router.routing.policy import Candidate

SESSION_HEADER = "X-Session-Id"
SESSION_BODY_FIELDS = ("prompt_cache_key", "user", "safety_identifier")  # in priority order
MAX_SESSION_ID_CHARS = 512  # longer ids are hashed as their first 512 characters
VNODES = 64  # points per replica on the ring: shares even out to a few percent


class SessionOutcome(enum.Enum):
    HIT = "hit"  # the session's last replica served it
    SPILL = "spill"  # its last replica was over the load bound: another one served it
    MOVED = "moved"  # its last replica had no cache for it, or left the pool
    NEW = "new"  # the router had not seen the session


class SessionPick(NamedTuple):
    url: str
    outcome: SessionOutcome


def session_id(header: str | None, body: Any) -> str | None:
    """The request's session id, or None (module docstring for the order)."""
    if header is not None and header.strip():
        return header.strip()[:MAX_SESSION_ID_CHARS]
    if isinstance(body, dict):
        for name in SESSION_BODY_FIELDS:
            value = body.get(name)
            if isinstance(value, str) and value.strip():
                return value.strip()[:MAX_SESSION_ID_CHARS]
    return None


def stable_hash(data: str) -> int:
    """64 bits, the same in every process (Python's hash() is salted per process)."""
    return int.from_bytes(hashlib.blake2b(data.encode("utf-8"), digest_size=8).digest(), "big")


def load_bound(total_in_flight: int, num_workers: int, load_factor: float) -> int:
    """The most requests a replica may hold after taking a new one (module docstring)."""
    assert num_workers > 0 and load_factor >= 1.0
    return math.ceil(load_factor * (total_in_flight + 1) / num_workers)


class HashRing:
    """Replicas at VNODES points each; rebuilt only when the set of replicas changes."""

    def __init__(self) -> None:
        self._urls: frozenset[str] = frozenset()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _rebuild(self, urls: frozenset[str]) -> None:
        ring = sorted((stable_hash(f"{u}#{i}"), u) for u in urls for i in range(VNODES))
        self._points = [p for p, _ in ring]
        self._owners = [u for _, u in ring]
        self._urls = urls

    def walk(self, key: str, urls: frozenset[str]) -> Iterator[str]:
        """Each of `urls` once, clockwise from `key`'s point."""
        if urls != self._urls:
            self._rebuild(urls)
        start = bisect.bisect(self._points, stable_hash(key))
        seen: set[str] = set()
        for i in range(len(self._owners)):
            url = self._owners[(start + i) % len(self._owners)]
            if url not in seen:
                seen.add(url)
                yield url
            if len(seen) == len(urls):
                return


class SessionAffinity:
    """Owned by the Router: choose() reads it through pick(), record() writes through note()."""

    def __init__(self, max_sessions: int, load_factor: float) -> None:
        assert max_sessions >= 1 and load_factor >= 1.0
        self.max_sessions = max_sessions
        self.load_factor = load_factor
        self._last: OrderedDict[str, str] = OrderedDict()  # least recently used first
        self._ring = HashRing()
        self.counts: dict[SessionOutcome, int] = dict.fromkeys(SessionOutcome, 0)

    def __len__(self) -> int:
        return len(self._last)

    def last(self, session: str) -> str | None:
        return self._last.get(session)

    def ring_pick(self, key: str, candidates: Sequence[Candidate],
                  skip: str | None = None) -> str:
        """The first candidate within the load bound clockwise from `key` (never `skip`)."""
        by_url = {c.url: c for c in candidates}
        bound = load_bound(sum(c.in_flight for c in candidates), len(candidates),
                           self.load_factor)
        fallback = None
        for url in self._ring.walk(key, frozenset(by_url)):
            if url == skip:
                continue
            fallback = fallback or url
            if by_url[url].in_flight + 1 <= bound:
                return url
        assert fallback is not None or skip is not None, "ring_pick needs a candidate"
        return fallback or str(skip)

    def pick(self, session: str, candidates: Sequence[Candidate]) -> SessionPick | None:
        """The replica for `session` among `candidates` (not empty); None: the prefix policy
        decides (the caller records MOVED or NEW)."""
        by_url: Mapping[str, Candidate] = {c.url: c for c in candidates}
        best_match = max(c.match_ratio for c in candidates)
        last = self._last.get(session)
        if last is not None and last in by_url:
            mine = by_url[last]
            if mine.match_ratio <= 0.0 < best_match:
                return None
            bound = load_bound(sum(c.in_flight for c in candidates), len(candidates),
                               self.load_factor)
            if mine.in_flight + 1 <= bound or len(candidates) == 1:
                return SessionPick(last, SessionOutcome.HIT)
            return SessionPick(self.ring_pick(session, candidates, skip=last),
                               SessionOutcome.SPILL)
        if best_match > 0.0:
            return None
        outcome = SessionOutcome.NEW if last is None else SessionOutcome.MOVED
        return SessionPick(self.ring_pick(session, candidates), outcome)

    def outcome_for_policy_choice(self, session: str) -> SessionOutcome:
        """What it is when pick() left the choice to the prefix policy."""
        return SessionOutcome.NEW if session not in self._last else SessionOutcome.MOVED

    def note(self, session: str, url: str, outcome: SessionOutcome) -> None:
        """Count the routed request; a spill leaves the session's replica as it was."""
        self.counts[outcome] += 1
        if outcome is SessionOutcome.SPILL:
            return
        self._last.pop(session, None)
        self._last[session] = url
        while len(self._last) > self.max_sessions:
            self._last.popitem(last=False)

    def forget_worker(self, url: str) -> None:
        """A removed replica: its sessions go to the ring (or a prefix match) next time."""
        for session in [s for s, u in self._last.items() if u == url]:
            del self._last[session]
