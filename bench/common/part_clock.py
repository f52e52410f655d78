"""Timing an offline engine's forward by part: the linear layers, attention, the rest.

Owns: `PartClock` (seconds per named part, accumulated by the callables it wraps) and
`time_parts`, which wraps a loaded model's linear kernels (each decoder layer's projections,
the packed MLP's activation GEMMs, the LM head) under "linear", the attention backend's
forward (its K/V store included) and attend (over K/V the layer stored itself, with RoPE:
that store is not in it) under "attention" and the whole forward under "forward", in place,
for this process.
bench/decode_floor.py and bench/prefill_floor.py share it. Does not know: workloads, floors,
which steps a benchmark keeps.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any


class PartClock:
    """Seconds per part, summed over every call of the callables `wrap` returned; `now` is
    the clock (wall time by default; time.thread_time: the calling thread's CPU time)."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.secs: dict[str, float] = defaultdict(float)
        self.now = now

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = self.now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.secs[name] += self.now() - t
        return timed

    def take(self) -> dict[str, float]:
        """The seconds so far, and start again from zero."""
        out = dict(self.secs)
        self.secs.clear()
        return out


class TimedKernel:
    """Stands in for a linear kernel (or a packed MLP's activation GEMMs): the same call
    forms, timed under `linear`; `inner` is the kernel itself (to call it untimed)."""

    def __init__(self, inner: Any, clock: PartClock) -> None:
        self.inner = inner
        self._call = clock.wrap("linear", inner.__call__)
        self.add_to = clock.wrap("linear", inner.add_to) if hasattr(inner, "add_to") else None
        self.nbytes = getattr(inner, "nbytes", 0)

    def __call__(self, *args: Any) -> Any:
        return self._call(*args)


def untimed(x: Any) -> Any:
    """The kernel a TimedKernel stands for (x itself otherwise)."""
    return x.inner if isinstance(x, TimedKernel) else x


def time_parts(model: Any, clock: PartClock) -> None:
    """Wrap `model`'s (a CausalLM with Llama-order layers: qkv, o_proj, mlp) linear kernels,
    its backend's forward and its forward, so that `clock` sums their seconds."""
    for layer in model.layers:
        mlp = layer.mlp
        for lin in (layer.qkv, layer.o_proj, mlp.down, mlp.gate_up):
            if lin is not None:
                lin.kernel = TimedKernel(lin.kernel, clock)
        if mlp.packed is not None:  # gate and up as two GEMMs with fused epilogues
            mlp.activation = TimedKernel(mlp.activation, clock)
    model.lm_head.kernel = TimedKernel(model.lm_head.kernel, clock)
    model.backend.forward = clock.wrap("attention", model.backend.forward)
    if hasattr(model.backend, "attend"):  # the layers stored K/V themselves (fused, CPU)
        model.backend.attend = clock.wrap("attention", model.backend.attend)
    model.forward = clock.wrap("forward", model.forward)
