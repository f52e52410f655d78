"""Tier work against the device's own timeline (issue 42, defects 5 and 6). Loads on a side stream
wait on the compute stream: the event is recorded on the engine thread when the load is
submitted (after the last queued forward, whose rope_qk_store may still write pages an aborted
request held) and the loader's stream waits on it before its first copy, then synchronizes.
The prefill cost model reads the step clock's device time. CPU tests with fake streams/events."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from radixserve.cache.radix_types import Tier
from radixserve.cache.tiers.block_io import BLOCK, KVCodec
from radixserve.cache.tiers.block_loader import BlockRead, TierLoader


class FakeStreams:
    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def mark(self) -> object:
        token = object()
        self.log.append(("mark", threading.current_thread().name, token))
        return token

    @contextlib.contextmanager
    def side(self, after: object) -> Iterator[None]:
        self.log.append(("wait", after))
        yield
        self.log.append(("synchronized",))


class LoggingCodec(KVCodec):
    def __init__(self, k: torch.Tensor, v: torch.Tensor, log: list[Any]) -> None:
        super().__init__(k, v)
        self.log = log

    def write(self, data: Any, slots: Any, skip: int) -> None:
        self.log.append(("write", tuple(slots)[0]))
        super().write(data, slots, skip)


def test_a_load_waits_on_the_compute_stream_event_recorded_at_submit() -> None:
    log: list[Any] = []
    k = torch.zeros(2, 4 * BLOCK, 1, 8)  # (layers, slots, heads, dim)
    codec = LoggingCodec(k, torch.zeros_like(k), log)
    block = torch.randn(1, 2, 2, BLOCK, 1, 8)[0]  # (2, layers, BLOCK, heads, dim)
    loader = TierLoader(codec, {Tier.LOCAL: None},  # type: ignore[dict-item]
                        lambda tier, key: block, streams=FakeStreams(log))  # type: ignore[arg-type]
    reads = [BlockRead("a", Tier.LOCAL, tuple(range(BLOCK, 2 * BLOCK)), 0),
             BlockRead("b", Tier.LOCAL, tuple(range(2 * BLOCK, 3 * BLOCK)), 0)]
    future = loader.submit(reads)
    done = future.result(timeout=30)
    loader.close()
    assert done.num_blocks == 2
    (_, thread, token), *rest = log
    assert thread == threading.current_thread().name  # recorded by the submitting thread
    assert rest == [("wait", token), ("write", BLOCK), ("write", 2 * BLOCK), ("synchronized",)]
    assert torch.equal(k[:, BLOCK:2 * BLOCK], block[0])


class SlowDeviceEvent:
    """A CUDA-like event: the device took 250 ms between any two events, whatever the host
    clock says (a chunk that samples nothing returns before the GPU finishes it)."""

    def __init__(self) -> None:
        self.recorded = False

    def record(self) -> None:
        self.recorded = True

    def query(self) -> bool:
        return self.recorded

    def elapsed_time(self, end: Any) -> float:
        return 250.0


def test_prefill_cost_model_reads_device_time_not_the_host_clock(tier_model: Any,
                                                                 tmp_path: Any) -> None:
    """Issue 42, defect 6: the tiers' prefill timings come from the step clock's events."""
    from radixserve.engine.step_clock import StepClock
    from tests.cache.tiers.engine_runs import make_llm, prompts, run

    llm = make_llm(tier_model, kv_offload_dir=tmp_path)
    llm.engine.clock = StepClock(SlowDeviceEvent)
    run(llm, prompts(1, 40, seed=3))
    (timing,) = llm.engine.timings.values()
    assert timing.prefill_tokens == 40 and timing.prefill_seconds == 0.25
    llm.close()
