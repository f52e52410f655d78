"""Tier loads on a side stream wait on the compute stream (issue 42, defect 5): the event is
recorded on the engine thread when the load is submitted (after the last queued forward, whose
rope_qk_store may still write pages an aborted request held) and the loader's stream waits on
it before its first copy, then synchronizes. CPU test with a fake stream pair."""

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
