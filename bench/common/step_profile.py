"""Decode steps under torch.profiler: GPU-busy share, kernels and host launches per step.

Owns: driving an offline engine to a batch of B decoding requests, timing N steps (plain and
profiled), and reducing the profiler's events to per-step figures. Does not know: which
model or engine settings (bench/gpu.py chooses them).

GPU busy = the union of the device's kernel and copy intervals inside the profiled steps,
divided by the wall time of the same steps measured without the profiler (its own host
overhead would otherwise understate the share). Kernels = device kernels run per step (inside
a CUDA graph too); launches = host launch calls per step (cudaLaunchKernel, cuLaunchKernel,
cudaGraphLaunch, ...): what a graph replaces by one.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve import LLM

RANGE_NAME = "bench.decode_steps"


@dataclass(frozen=True)
class StepProfile:
    batch: int
    steps: int
    step_ms: float  # wall per decode step, no profiler
    gpu_busy: float  # share of step_ms the device is busy (0..1)
    kernels_per_step: float
    launches_per_step: float


def union_us(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of [start, end) intervals clipped to [lo, hi)."""
    total, cur_start, cur_end = 0.0, None, None
    for start, end in sorted((max(s, lo), min(e, hi)) for s, e in intervals):
        if end <= start:
            continue
        if cur_end is None or start > cur_end:
            if cur_end is not None and cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    if cur_end is not None and cur_start is not None:
        total += cur_end - cur_start
    return total


def is_launch(name: str) -> bool:
    return "Launch" in name and (name.startswith("cu") or name.startswith("cuda"))


def is_device_kernel(name: str) -> bool:
    return not name.startswith(("Memcpy", "Memset"))


def start_decoding(llm: LLM, batch: int, input_len: int, max_tokens: int, vocab: int,
                   seed: int) -> None:
    """Admit `batch` random prompts and step until every one has its first token."""
    import torch

    from radixserve.ipc.messages import GenerateMsg
    from radixserve.types import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        ids = torch.randint(1, vocab, (input_len,), generator=gen).tolist()
        llm.engine.add_request(GenerateMsg(f"prof-{seed}-{i}", ids, params))
    started: set[str] = set()
    while len(started) < batch:
        started.update(o.rid for o in llm.engine.step())


def profile_decode(llm: LLM, batch: int, input_len: int, steps: int, vocab: int,
                   seed: int) -> StepProfile:
    import torch
    from torch.profiler import DeviceType, ProfilerActivity, profile, record_function

    engine = llm.engine
    start_decoding(llm, batch, input_len, 2 * steps + 4, vocab, seed)
    for _ in range(2):  # warm
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - t0) / steps
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function(RANGE_NAME):
            for _ in range(steps):
                engine.step()
        torch.cuda.synchronize()
    while engine.has_work():
        engine.step()
    events = prof.events()
    span = next(e for e in events if e.name == RANGE_NAME and e.device_type == DeviceType.CPU)
    lo, hi = span.time_range.start, span.time_range.end
    device = [e for e in events if e.device_type == DeviceType.CUDA
              and lo <= e.time_range.start < hi]
    busy_us = union_us(((e.time_range.start, e.time_range.end) for e in device), lo, hi)
    kernels = sum(is_device_kernel(e.name) for e in device)
    launches = sum(is_launch(e.name) for e in events
                   if e.device_type == DeviceType.CPU and lo <= e.time_range.start < hi)
    return StepProfile(batch, steps, step_s * 1e3, min(1.0, busy_us / steps / (step_s * 1e6)),
                       kernels / steps, launches / steps)
