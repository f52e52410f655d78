"""Waiting for queued device work with a deadline and a liveness check, and timing it.

Why: NCCL collectives (and every CUDA launch) return when queued, so a dead or hung peer never
raises where the host issued the collective; the host would block later in a `.tolist()` or a
synchronize that nothing can interrupt. Waiting here instead (polling an event recorded after
the queued work) lets rank 0 ask its monitor between polls whether a rank died, and give up
after a deadline, with a clear error. On gloo (CPU) collectives are synchronous: nothing waits.

Owns: wait_done (the poll loop) and CollectiveTimer (collective time measured where the work
runs: CUDA event pairs on CUDA, the host clock where collectives are synchronous).
Does not know: process groups, ranks, what the work is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

import torch

POLL_S = 0.0005  # the first polls: a step's collectives usually finish within a few ms
CHECK_EVERY_S = 0.05  # how often the liveness check runs while waiting


class Completion(Protocol):
    """What wait_done polls: torch.cuda.Event's query()."""

    def query(self) -> bool: ...


class CollectiveTimeout(RuntimeError):
    """Queued collectives did not finish within the deadline (a hung peer)."""


def wait_done(done: Completion, check: Callable[[], None], timeout_s: float,
              what: str = "collectives") -> None:
    """Return once `done` completed; `check()` runs every CHECK_EVERY_S meanwhile (it raises
    when a peer is known dead); CollectiveTimeout after `timeout_s`."""
    if done.query():
        return
    start = last_check = time.monotonic()
    sleep = POLL_S
    while not done.query():
        now = time.monotonic()
        if now - last_check >= CHECK_EVERY_S:
            check()
            last_check = now
        if now - start > timeout_s:
            raise CollectiveTimeout(f"{what} did not finish within {timeout_s:.0f} s "
                                    "(a tensor-parallel rank hangs)")
        time.sleep(sleep)
        sleep = min(sleep * 2, CHECK_EVERY_S / 5)


class CollectiveTimer:
    """Seconds spent inside collectives. On CUDA each collective is bracketed by two events on
    the current stream and counted once both completed (the GPU's time, not the launch's);
    otherwise by the host clock (gloo returns when the collective is done)."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._seconds = 0.0
        self.count = 0

    def start(self) -> object:
        """A token for stop(): an event recorded now (CUDA) or the host clock."""
        if self._cuda:
            ev = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, token: object) -> None:
        self.count += 1
        if isinstance(token, float):
            self._seconds += time.perf_counter() - token
            return
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end.record()
        assert isinstance(token, torch.cuda.Event)
        self._pending.append((token, end))

    def done_event(self) -> Completion | None:
        """An event recorded after everything queued so far (None where collectives are
        synchronous)."""
        if not self._cuda:
            return None
        ev = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ev.record()
        return ev

    @property
    def seconds(self) -> float:
        still: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        for a, b in self._pending:
            if b.query():  # type: ignore[no-untyped-call]
                self._seconds += a.elapsed_time(b) / 1e3
            else:
                still.append((a, b))
        self._pending = still
        return self._seconds
