"""The circuit breaker of each worker: which failures count, and how an ejected worker returns.

Owns: the classification of an upstream outcome (a fault of the replica, or backpressure),
the breaker's transitions and its cool-down, and the state a worker is shown in (GET /workers,
`radixserve_router:worker_state`). Does not know: HTTP handlers, routing policies; the fields it
moves live on workers.Worker (`suspect` is the open breaker, as before this module).

Faults (count against a worker): connection errors (refused, reset, timed out connecting),
streams broken mid-way, streams stalled past --stream-stall-timeout, and 5xx answers except
a draining replica's 503 (code "draining": it is shutting down on purpose and its /health
already says so). Never faults: 4xx and 429 (backpressure or the caller's own fault: sglang
#25811 ejected a whole fleet for its clients' 400s), and the draining 503.

States:
  closed     gets requests;
  open       a fault was seen: no requests while a closed or half-open worker is routable,
             for at least the cool-down (`cooldown_s` x 2^(trips-1), at most `max_cooldown_s`;
             trips counts consecutive openings) and until a health probe succeeds;
  half_open  a probe succeeded after the cool-down: one trial request at a time; its success
             closes the breaker (trips back to 0), a fault opens it again, longer;
  down       the health probes failed `fail_threshold` times (workers.py's hysteresis).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable
from typing import Protocol

import orjson

DRAINING_CODE = "draining"  # the replica's 503 code while it shuts down (server/state.py)


class WorkerState(str, enum.Enum):
    CLOSED = "closed"
    HALF_OPEN = "half_open"
    OPEN = "open"
    DOWN = "down"


class BreakerFields(Protocol):
    """What the breaker reads and moves on a worker: workers.Worker's fields (workers.py
    imports this module, never the other way round)."""

    healthy: bool
    suspect: bool  # the open breaker
    half_open: bool
    trips: int
    open_until: float


# radixserve_router:worker_state's value per state (a gauge: 0 is the healthy one).
STATE_VALUE = {WorkerState.CLOSED: 0, WorkerState.HALF_OPEN: 1, WorkerState.OPEN: 2,
               WorkerState.DOWN: 3}


def state_of(worker: BreakerFields) -> WorkerState:
    if not worker.healthy:
        return WorkerState.DOWN
    if worker.suspect:
        return WorkerState.OPEN
    return WorkerState.HALF_OPEN if worker.half_open else WorkerState.CLOSED


def _error_code(body: bytes) -> object:
    try:
        error = orjson.loads(body).get("error")
    except (orjson.JSONDecodeError, AttributeError):
        return None
    return error.get("code") if isinstance(error, dict) else None


def is_fault(status: int, body: bytes) -> bool:
    """Whether an answer with `status` (and `body`) counts against the worker."""
    if status < 500:
        return False
    return not (status == 503 and _error_code(body) == DRAINING_CODE)


class Breaker:
    """The transitions; the WorkerPool owns one and calls it (one owner of Worker fields)."""

    def __init__(self, cooldown_s: float = 1.0, max_cooldown_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        assert 0 <= cooldown_s <= max_cooldown_s
        self.cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self._clock = clock

    def trip(self, worker: BreakerFields) -> None:
        """A fault: open (again), for a cool-down that doubles with consecutive trips."""
        worker.trips += 1
        worker.suspect = True
        worker.half_open = False
        cooldown = min(self.max_cooldown_s, self.cooldown_s * 2 ** (worker.trips - 1))
        worker.open_until = self._clock() + cooldown

    def probe_ok(self, worker: BreakerFields) -> None:
        """A health probe succeeded: an open breaker past its cool-down turns half-open."""
        if worker.suspect and self._clock() >= worker.open_until:
            worker.suspect = False
            worker.half_open = True

    def success(self, worker: BreakerFields) -> None:
        """A request succeeded (the whole answer relayed): closes a half-open breaker."""
        if worker.half_open and not worker.suspect:
            worker.half_open = False
            worker.trips = 0
