"""What `--dtype auto` resolves to: bf16 where the hardware multiplies bf16 natively, else fp32.

Owns: reading the CPU's flags, the start-up bf16-vs-fp32 matmul measurement, and the rule
that combines them (with a sentence saying why, for the start-up log). Does not know:
configs, the model, logging (the caller logs the reason).

The rule: CUDA -> bf16. CPU with AMX (amx_bf16) -> bf16. CPU with AVX512-BF16 but no AMX ->
measure a decode-shaped matmul both ways and take bf16 only if it wins by MIN_BF16_SPEEDUP
(on this project's EPYC it does; figures in bench/README.md). Anything else (AVX2-only: bf16
is emulated, much slower) -> fp32. A $RADIXSERVE_CPU_ISA cap hides the flags above it, so
`RADIXSERVE_CPU_ISA=avx2` on an AVX-512 machine picks what an AVX2 machine picks (fp32).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.platform.cpu_isa import CpuIsa, TierChoice

MIN_BF16_SPEEDUP = 1.2  # below this, bf16's rounding is not worth it
_PROBE_ROWS, _PROBE_IN, _PROBE_OUT = 32, 576, 3072  # a batch-32 decode through an MLP up-proj
_PROBE_REPS = 7


@dataclass(frozen=True)
class DtypeChoice:
    dtype: torch.dtype
    reason: str  # one line for the start-up log

    def describe(self) -> str:
        return f"dtype auto -> {str(self.dtype).removeprefix('torch.')}: {self.reason}"


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The first `flags` line of /proc/cpuinfo as a set (empty where there is none)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def _best_time(fn: Callable[[], object]) -> float:
    fn()  # warm-up: oneDNN primitive creation, page faults
    best = float("inf")
    for _ in range(_PROBE_REPS):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_bf16_speedup() -> float:
    """fp32 F.linear time / prepacked-bf16 oneDNN linear time on one core; 0.0 if unusable.

    The minimum of several runs, so that a busy neighbour core inflates neither side. One
    thread: the ratio per core is what matters, and a parallel region on a shared box is noise.
    """
    if not (torch._C._has_mkldnn and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return 0.0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(_PROBE_ROWS, _PROBE_IN, generator=gen)
        w = torch.randn(_PROBE_OUT, _PROBE_IN, generator=gen)
        xb = x.bfloat16()
        packed = torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), _PROBE_ROWS)
        t32 = _best_time(lambda: F.linear(x, w))
        t16 = _best_time(lambda: torch.ops.mkldnn._linear_pointwise(xb, packed, None, "none",
                                                                     [], ""))
    except RuntimeError:
        return 0.0
    finally:
        torch.set_num_threads(threads)
    return t32 / t16


def _capped(flags: frozenset[str], tier: TierChoice | None) -> tuple[frozenset[str], str]:
    """The flags with those above a $RADIXSERVE_CPU_ISA cap removed, and a note for the reason."""
    if tier is None or not tier.capped:
        return flags, ""
    hidden: set[str] = set()
    if tier.tier.rank < CpuIsa.AMX.rank:
        hidden |= {"amx_bf16"}
    if tier.tier.rank < CpuIsa.AVX512_BF16.rank:
        hidden |= {"avx512_bf16"}
    note = f" (kernels capped at {tier.tier.value} by RADIXSERVE_CPU_ISA)" if hidden & flags else ""
    return flags - hidden, note


def choose_auto_dtype(device: torch.device, flags: frozenset[str],
                      measure: Callable[[], float] = measure_bf16_speedup,
                      tier: TierChoice | None = None) -> DtypeChoice:
    """`tier`: the native kernels' tier; a cap below the CPU's best counts as that CPU."""
    if device.type != "cpu":
        return _choose(device, flags, "", measure)
    return _choose(device, *_capped(flags, tier), measure)


def _choose(device: torch.device, flags: frozenset[str], note: str,
            measure: Callable[[], float]) -> DtypeChoice:
    if device.type == "cuda":
        return DtypeChoice(torch.bfloat16, "CUDA device")
    if device.type != "cpu":
        return DtypeChoice(torch.float32, f"{device.type} device")
    if "amx_bf16" in flags:
        return DtypeChoice(torch.bfloat16, "CPU has AMX (amx_bf16)")
    if "avx512_bf16" not in flags:
        return DtypeChoice(torch.float32, "CPU has neither amx_bf16 nor avx512_bf16 "
                                          f"(bf16 matmul would be emulated){note}")
    speedup = measure()
    if speedup >= MIN_BF16_SPEEDUP:
        return DtypeChoice(torch.bfloat16, f"CPU has avx512_bf16, bf16 matmul {speedup:.1f}x "
                                           "fp32 measured")
    return DtypeChoice(torch.float32, f"CPU has avx512_bf16 but bf16 matmul only "
                                      f"{speedup:.2f}x fp32 measured (< {MIN_BF16_SPEEDUP}x)")
