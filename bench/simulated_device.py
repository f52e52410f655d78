"""Overlap scheduling measured without a GPU: the forward replaced by a wait of T ms that
releases the GIL (as a GPU kernel does), run on a simulated device (a worker thread, in
order, as a CUDA stream), step time with and without overlap. As on a GPU, the host
launches (the engine's launch code and the forward's Python run on the host thread) and
only the forward's device time, the wait, runs on the device.

    python -m bench.overhead --simulated-device-ms 5      # batches 1, 64, 256

Without overlap a step is host + T (the host waits for each forward before planning the
next); with it about max(host, T). `host` is measured in the same run: the step time with a
forward of 0 ms, synchronous. Does not know: real kernels (bench.gpu measures those).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

import torch

from radixserve.engine.overlap import DeviceQueue

WARM_STEPS = 4


def _sleeping_forward(seconds: float, waits: list[float], queue: DeviceQueue | None) -> Any:
    """The forward's device time as a wait: queued on the simulated device (`queue`), or
    waited here (a synchronous device). `waits` gets each wait's real length: on a loaded
    machine a sleep overshoots, and the device time the overlap can hide is the real one."""
    def wait() -> None:
        t = time.perf_counter()
        time.sleep(seconds)  # the GIL is free meanwhile, as during a GPU kernel
        waits.append(time.perf_counter() - t)

    def forward(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if queue is None:
            wait()
        else:
            queue.submit(wait)  # launched: the host goes on, as after a kernel launch
        logit_rows = args[4]  # (positions, meta, k, v, logit_rows, scales)
        return torch.zeros((logit_rows.shape[0], 1024), dtype=torch.float32)  # (N, vocab)
    return forward


def step_ms(model: str, batch: int, steps: int, device_ms: float, overlap: bool
            ) -> tuple[float, float]:
    """Median wall ms of a decode step at `batch` requests (greedy, ignore_eos), and the
    median real length of the simulated forward's wait over the same steps (with overlap the
    timed steps wait for the forwards launched one step earlier: the same count)."""
    from radixserve import LLM
    from radixserve.ipc.messages import GenerateMsg
    from radixserve.types import SamplingParams

    queue = DeviceQueue() if overlap else None
    llm = LLM(model=model, dtype="float32", device="cpu", num_threads=1,
              max_running_requests=batch, kv_cache_tokens=max(batch, 4) * 512,
              max_model_len=512,
              max_prefill_tokens=batch * 16, chunked_prefill_size=0,
              overlap_on_cpu=overlap, disable_overlap_schedule=not overlap)
    engine = llm.engine
    # NOTE: the bench patches the model instance (no second model class for one bench)
    waits: list[float] = []
    engine.runner.model.forward = _sleeping_forward(  # type: ignore[method-assign]
        device_ms / 1e3, waits, queue)
    engine.device_queue = queue
    params = SamplingParams(temperature=0, max_tokens=steps + WARM_STEPS + 4, ignore_eos=True)
    for i in range(batch):
        engine.add_request(GenerateMsg(f"s{i}", [3 + i % 500] * 16, params))
    for _ in range(WARM_STEPS):
        engine.step()
    times = []
    waits.clear()  # the waits of the timed steps only (the prefill's and the drain's vary)
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    waits[:] = waits[:steps]
    for i in range(batch):
        engine.abort(f"s{i}")
    while engine.has_work():
        engine.step()
    llm.close()
    return 1e3 * statistics.median(times), 1e3 * statistics.median(waits or [0.0])


def report(model: str, batches: list[int], steps: int, device_ms: float,
           rounds: int = 3) -> list[str]:
    """Per batch: host alone, then T without and with overlap, alternating, `rounds` times;
    the medians (the machine is shared: one round is noisy)."""
    # NOTE: the simulated device is a Python thread: when its wait ends it needs the GIL
    # back to hand over its result, and the host thread, busy planning the next step, keeps
    # it for up to the switch interval (5 ms by default: a whole simulated forward). A GPU
    # needs no GIL; a short interval makes the thread's hand-over about as prompt.
    sys.setswitchinterval(1e-4)
    lines = [f"simulated device: forward = a {device_ms:g} ms wait (GIL released), wall ms per "
             f"decode step (median of {steps} steps, median of {rounds} alternating rounds)"]
    for b in batches:
        runs: dict[str, list[float]] = {"host": [], "off": [], "on": [], "wait": []}
        for i in range(rounds):
            order = [("host", 0.0, False), ("off", device_ms, False), ("on", device_ms, True)]
            for name, ms, overlap in (order if i % 2 == 0 else order[::-1]):
                step, wait = step_ms(model, b, steps, ms, overlap)
                runs[name].append(step)
                if name == "on":
                    runs["wait"].append(wait)
        host, off, on, real = (statistics.median(runs[k]) for k in ("host", "off", "on", "wait"))
        lines.append(f"  batch {b:>4}: host {host:6.2f}; without overlap {off:6.2f} "
                     f"(host + T = {host + device_ms:6.2f}); with overlap {on:6.2f} "
                     f"= {on / max(host, device_ms):4.2f}x max(host, T); the wait really "
                     f"took {real:5.2f}: {on / max(host, real):4.2f}x max(host, real T)")
    return lines
