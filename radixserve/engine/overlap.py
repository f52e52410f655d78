"""Overlap scheduling (SGLang's): the host plans and prepares step N+1 while the device runs N.

Order of one overlapped engine step (N-1 launched by the step before):
  1. schedule N (a plain decode: the scheduler advanced every request past N-1's position at
     its launch, so N's positions and slots are known; N-1's sampled tokens are not);
  2. prepare N on the host and launch it: N-1's tokens feed N on the device (placeholders in
     N's input ids, filled from N-1's sampled tensor: resolve_pending), no host sync;
  3. wait for N-1's tokens (by now usually done) and process them one step late (stop rules,
     finishing, streaming) while the device runs N.
A request that finishes at N-1 was also computed in N: that token is dropped (its request is
FINISHED when N is processed), so no client sees a token past its stop or max_tokens.

Which steps overlap: plain decode steps whose every request samples exactly without its last
token (Scheduler.overlappable: no grammar, penalties, min_tokens, seed, logprobs, drafts or
speculation, no prompt waiting, no preemption needed). Anything else drains the step in
flight first and runs synchronously, as with --disable-overlap-schedule.

Owns: the step in flight (InFlight) and launching a step on the device, a simulated device
included (DeviceQueue: a CUDA stream's stand-in on CPU, for bench.overhead and tests). The
host always runs the launch itself (inputs, placeholders, the model's Python forward, the
sampler's call): on CUDA that queues kernels; on a simulated device the forward queues its
device time on the DeviceQueue and the step's tokens are read once the queue ran past the
step's marker. Reads the batch and requests, never writes a request (the scheduler does,
through advance and process_outputs). Does not know: HTTP.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from radixserve.sched.decode import DecodeRows
from radixserve.sched.req import Batch

if TYPE_CHECKING:
    from radixserve.engine.model_runner import ModelRunner


def _reached() -> None:
    """A marker's work: nothing (its future completes once the queue got this far)."""


class DeviceQueue:
    """A simulated asynchronous device: the device time of the work the host launched (a
    forward's kernels, as a wait) runs on one worker thread, in order, as a CUDA stream runs
    kernels; `record` marks the point after everything queued so far, as a CUDA event."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sim-device")

    def submit(self, work: Callable[[], None]) -> Future[None]:
        return self._pool.submit(work)

    def record(self) -> Future[None]:
        return self._pool.submit(_reached)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


@dataclass
class InFlight:
    """A launched decode step whose tokens the host has not read yet."""

    batch: Batch
    rows: DecodeRows
    tokens: torch.Tensor  # (B,) on the device
    marker: Future[None] | None = None  # a simulated device's: the step ran
    host: torch.Tensor | None = None  # (B,) pinned, filled by an async copy (CUDA)
    event: torch.cuda.Event | None = None

    def token_ids(self) -> list[int]:
        """Block until the step's tokens are on the host."""
        if self.marker is not None:
            self.marker.result()
        if self.event is not None and self.host is not None:
            self.event.synchronize()
            return self.host.tolist()
        return self.tokens.tolist()


def resolve_pending(input_ids: torch.Tensor, rows: DecodeRows, prev: DecodeRows,
                    prev_tokens: torch.Tensor) -> None:
    """Fill the placeholders of a step's input ids (B,) with the tokens the step before
    sampled (prev_tokens (B',), on the device): every request of `rows` ran in `prev`."""
    if rows is prev:  # the same running set: the tokens in order
        input_ids.copy_(prev_tokens)
        return
    where = {id(r): j for j, r in enumerate(prev.reqs)}
    src = [where[id(r)] for r in rows.reqs]
    index = torch.tensor(src, dtype=torch.int64).to(prev_tokens.device, non_blocking=True)
    input_ids.copy_(prev_tokens.index_select(0, index))


def launch(runner: ModelRunner, batch: Batch, prev: InFlight | None,
           queue: DeviceQueue | None) -> InFlight:
    """Prepare `batch` (a plain decode) on the host and queue its forward and sampling on the
    device, its placeholders filled from `prev`'s tokens there. Returns without a host sync."""
    rows = batch.rows
    assert rows is not None and rows.overlap_ok
    # Host work: positions, slots, the slot table; the ids on the device after `prev`.
    inputs = runner.prepare(batch, placeholders=prev is not None)
    # The launch, on the host as on CUDA: the placeholders' copy, the forward and the
    # sampling are queued behind `prev` on the device (a simulated device: the forward
    # queued its device time there); nothing here waits for `prev`.
    if prev is not None:
        resolve_pending(inputs.input_ids, rows, prev.rows, prev.tokens)
    logits = runner.logits(batch, inputs)  # (B, vocab)
    tokens = runner.sampler.sample_tensor(logits, rows.reqs, rows.plain_sampling)  # (B,)
    if queue is not None:
        return InFlight(batch, rows, tokens, queue.record())
    if tokens.device.type != "cuda":
        return InFlight(batch, rows, tokens)
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
    event.record()
    return InFlight(batch, rows, tokens, None, host, event)
