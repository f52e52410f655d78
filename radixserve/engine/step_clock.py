"""How long a step ran on the device: CUDA events on CUDA, the host clock on CPU.

Why: a CUDA forward whose chunk samples nothing returns once its kernels are queued, so the
host clock around `runner.run` measures launches, not the prefill the tiers' cost model
needs. A timing is delivered once its end event completed (polled, never waited on), one step
late or so; a CPU "event" is the host clock and completes at once.

Owns: StepClock (start/stop pairs with a caller's tag, the finished ones drained in order).
Does not know: what the tag is (the engine's prefill sample), the model, the tiers.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

import torch

T = TypeVar("T")


class TimingEvent(Protocol):
    """torch.cuda.Event(enable_timing=True)'s part that StepClock uses."""

    def record(self) -> None: ...
    def query(self) -> bool: ...
    def elapsed_time(self, end: TimingEvent) -> float: ...  # ms


class HostEvent:
    """The host clock as an event: complete as soon as recorded."""

    def __init__(self) -> None:
        self.t = 0.0

    def record(self) -> None:
        self.t = time.perf_counter()

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: TimingEvent) -> float:
        assert isinstance(end, HostEvent)
        return 1e3 * (end.t - self.t)


def _cuda_event() -> Any:  # a TimingEvent
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def event_factory(device: torch.device) -> Callable[[], TimingEvent]:
    return _cuda_event if device.type == "cuda" else HostEvent


class StepClock(Generic[T]):
    def __init__(self, make_event: Callable[[], TimingEvent]) -> None:
        self._make = make_event
        self._pending: deque[tuple[TimingEvent, TimingEvent, T]] = deque()

    def start(self) -> TimingEvent:
        event = self._make()
        event.record()
        return event

    def stop(self, start: TimingEvent, tag: T) -> None:
        end = self._make()
        end.record()
        self._pending.append((start, end, tag))

    def done(self) -> list[tuple[T, float]]:
        """(tag, seconds) of the timings complete by now, oldest first."""
        out: list[tuple[T, float]] = []
        while self._pending and self._pending[0][1].query():
            start, end, tag = self._pending.popleft()
            out.append((tag, start.elapsed_time(end) / 1e3))
        return out
