"""The worker registry: each replica's health, load and counters, and the health-check loop.

Owns: Worker records (mutated only through WorkerPool and Worker methods) and the periodic
`GET /health` probes with hysteresis: `fail_threshold` consecutive failures mark a worker
down, `success_threshold` consecutive successes bring it back. A connection error seen by the
proxy (a fault, breaker.py) marks a worker *suspect* (its breaker open): it gets no new
requests (while any non-suspect worker is up) until its cool-down is over and a probe succeeds
(then half-open: one trial request at a time), and the health loop probes at once.
A *draining* worker (service discovery: its pod is terminating or not Ready) gets no new
requests at all; the ones already sent to it finish.
Does not know: routing policies, the prefix indexes, request bodies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import aiohttp

from router.breaker import Breaker, state_of

log = logging.getLogger(__name__)


class WorkerExistsError(ValueError):
    pass


class UnknownWorkerError(KeyError):
    pass


@dataclass
class Worker:
    url: str
    healthy: bool = True  # optimistic at start; the first probes run at once
    suspect: bool = False
    draining: bool = False  # discovery: pod terminating or not Ready; in-flight ones finish
    in_flight: int = 0
    consecutive_failures: int = 0
    consecutive_successes: int = 0
    num_routed: int = 0
    num_errors: int = 0  # connection failures, 5xx answers, streams broken mid-way
    prefix_query_blocks: int = 0  # sum over routed requests of their blocks
    prefix_hit_blocks: int = 0  # ... and of the blocks the router believed this worker held
    last_error: str | None = None
    # The breaker (breaker.py): `suspect` is its open state.
    half_open: bool = False  # back on probation: one trial request at a time
    trips: int = 0  # consecutive openings (the cool-down doubles with each)
    open_until: float = 0.0  # monotonic time before which no probe closes it

    @property
    def est_hit_rate(self) -> float:
        return self.prefix_hit_blocks / self.prefix_query_blocks if self.prefix_query_blocks else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "url": self.url, "healthy": self.healthy, "suspect": self.suspect,
            "draining": self.draining,
            "in_flight": self.in_flight, "routed": self.num_routed, "errors": self.num_errors,
            "est_hit_rate": round(self.est_hit_rate, 4), "last_error": self.last_error,
            "state": state_of(self).value,
        }


class WorkerPool:
    def __init__(self, urls: tuple[str, ...], fail_threshold: int, success_threshold: int,
                 breaker: Breaker | None = None) -> None:
        self.breaker = breaker or Breaker()
        self.fail_threshold = fail_threshold
        self.success_threshold = success_threshold
        self._workers: dict[str, Worker] = {u: Worker(u) for u in urls}
        self.probe_soon = asyncio.Event()  # set when a worker turns suspect

    def __contains__(self, url: str) -> bool:
        return url in self._workers

    def get(self, url: str) -> Worker | None:
        return self._workers.get(url)

    def all(self) -> list[Worker]:
        return list(self._workers.values())

    def add(self, url: str) -> Worker:
        if url in self._workers:
            raise WorkerExistsError(url)
        worker = self._workers[url] = Worker(url)
        self.probe_soon.set()
        return worker

    def remove(self, url: str) -> Worker:
        """Unregister; requests already sent to it finish (they hold the Worker object)."""
        try:
            return self._workers.pop(url)
        except KeyError:
            raise UnknownWorkerError(url) from None

    def routable(self, exclude: frozenset[str] = frozenset()) -> list[Worker]:
        """Healthy workers not in `exclude` nor draining; suspect ones (and half-open ones
        already running their trial request) only when nothing else is left."""
        healthy = [w for w in self._workers.values()
                   if w.healthy and not w.draining and w.url not in exclude]
        trusted = [w for w in healthy if not w.suspect and not (w.half_open and w.in_flight)]
        return trusted or healthy

    def any_healthy(self) -> bool:
        return any(w.healthy for w in self._workers.values())

    def mark_suspect(self, worker: Worker, error: str) -> None:
        """A fault (breaker.is_fault): the breaker opens."""
        self.breaker.trip(worker)
        worker.num_errors += 1
        worker.last_error = error
        self.probe_soon.set()

    def record_probe(self, worker: Worker, ok: bool, error: str | None = None) -> None:
        if ok:
            worker.consecutive_failures = 0
            worker.consecutive_successes += 1
            self.breaker.probe_ok(worker)
            if not worker.healthy and worker.consecutive_successes >= self.success_threshold:
                worker.healthy = True
                log.info("worker %s is up", worker.url)
            return
        worker.consecutive_successes = 0
        worker.consecutive_failures += 1
        worker.last_error = error
        if worker.healthy and worker.consecutive_failures >= self.fail_threshold:
            worker.healthy = False
            log.warning("worker %s is down: %s", worker.url, error)


async def probe(session: aiohttp.ClientSession, url: str, timeout_s: float) -> str | None:
    """None if `url`/health answered 200 in time, else what went wrong."""
    try:
        async with session.get(f"{url}/health",
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            await resp.read()
            return None if resp.status == 200 else f"/health answered {resp.status}"
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        return f"/health failed: {e!r}"


async def probe_all(session: aiohttp.ClientSession, pool: WorkerPool, timeout_s: float) -> None:
    workers = pool.all()
    errors = await asyncio.gather(*(probe(session, w.url, timeout_s) for w in workers))
    for worker, error in zip(workers, errors, strict=True):
        if pool.get(worker.url) is worker:  # removed meanwhile: nothing to record
            pool.record_probe(worker, error is None, error)


async def health_loop(
    session: aiohttp.ClientSession, pool: WorkerPool, interval_s: float, timeout_s: float
) -> None:
    """Probe every worker now and every `interval_s` (sooner when one turns suspect)."""
    while True:
        pool.probe_soon.clear()
        await probe_all(session, pool, timeout_s)
        # A floor between rounds, so a burst of suspect marks cannot spin the loop.
        await asyncio.sleep(min(interval_s, 0.05))
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancel that lands
        # as the event fires, and the loop would then sleep a whole interval past shutdown.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(interval_s):
                await pool.probe_soon.wait()
