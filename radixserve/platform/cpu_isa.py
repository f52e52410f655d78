"""Which x86-64 instruction-set tier the native CPU kernels are built for and run at.

Owns: the tiers (`CpuIsa`: portable < avx2 < avx512 < avx512_bf16 < amx), the compiler flags
each is built with (-march per tier, never -march=native: a build is defined by its tier, not
by the machine that compiled it), which tiers this CPU can execute (its /proc/cpuinfo flags),
and the tier a process runs: the best the CPU has, capped by $RADIXSERVE_CPU_ISA; a cap above
the CPU's best is refused (`CpuIsaError`). Does not know: torch, the extensions, building
(platform/native_build.py and platform/kernels.py do).

`portable` has no intrinsics (plain C++ the compiler may auto-vectorize for baseline x86-64,
or the machine's default elsewhere): what a non-x86 CPU gets, and the floor of every fallback.
"""

from __future__ import annotations

import contextlib
import enum
import os
import platform
from dataclasses import dataclass
from pathlib import Path

ENV_CPU_ISA = "RADIXSERVE_CPU_ISA"  # cap the tier: portable, avx2, avx512, avx512_bf16, amx


class CpuIsaError(ValueError):
    """$RADIXSERVE_CPU_ISA names no tier, or one this CPU cannot execute."""


class CpuIsa(enum.Enum):
    PORTABLE = "portable"
    AVX2 = "avx2"
    AVX512 = "avx512"
    AVX512_BF16 = "avx512_bf16"
    AMX = "amx"

    @property
    def rank(self) -> int:
        return list(CpuIsa).index(self)


# The /proc/cpuinfo flags a tier's code may use: x86-64-v3 is AVX2, FMA, F16C, BMI1/2, LZCNT
# (`abm`) and MOVBE; x86-64-v4 adds AVX-512 F/BW/CD/DQ/VL; avx512_bf16 also needs VBMI and
# VNNI (its -march below); each tier includes the one below.
_NEEDS: dict[CpuIsa, frozenset[str]] = {
    CpuIsa.PORTABLE: frozenset(),
    CpuIsa.AVX2: frozenset({"avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe"}),
    CpuIsa.AVX512: frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
    CpuIsa.AVX512_BF16: frozenset({"avx512_bf16", "avx512vbmi", "avx512_vnni"}),
    CpuIsa.AMX: frozenset({"amx_tile", "amx_bf16", "amx_int8"}),
}

# -march per tier. avx512_bf16 adds VNNI and VBMI (every AVX512-BF16 part has them: Cooper
# Lake has VNNI, Zen 4 / Sapphire Rapids both) because the fp8 decode's byte-permute table
# needs VBMI; the amx tier adds the tile instructions on top.
_MARCH: dict[CpuIsa, tuple[str, ...]] = {
    CpuIsa.PORTABLE: ("-march=x86-64", "-mtune=generic"),
    CpuIsa.AVX2: ("-march=x86-64-v3",),
    CpuIsa.AVX512: ("-march=x86-64-v4",),
    CpuIsa.AVX512_BF16: ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mavx512vbmi"),
    CpuIsa.AMX: ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni", "-mavx512vbmi",
                 "-mamx-tile", "-mamx-bf16", "-mamx-int8"),
}


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def buildable_tiers() -> tuple[CpuIsa, ...]:
    """The tiers an extension is built for on this platform (any x86 host compiles all of
    them; elsewhere only portable exists)."""
    return tuple(CpuIsa) if is_x86() else (CpuIsa.PORTABLE,)


def march_flags(tier: CpuIsa) -> tuple[str, ...]:
    """The compiler's target flags for `tier` (none for portable off x86: the default)."""
    if not is_x86():
        return ()
    return _MARCH[tier]


def ops_namespace(tier: CpuIsa) -> str:
    """The torch.ops namespace a tier's build registers its ops in (RADIXSERVE_OPS_NS in the
    C++): one per tier, so several tiers' builds load side by side in one process."""
    return f"radixserve_{tier.value}"


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags (/proc/cpuinfo's first `flags` line; empty where unreadable)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def host_tiers(flags: frozenset[str] | None = None) -> tuple[CpuIsa, ...]:
    """The tiers this CPU can execute, lowest first (portable always; each tier needs its own
    flags and every lower tier's)."""
    if not is_x86():
        return (CpuIsa.PORTABLE,)
    have = cpu_flags() if flags is None else flags
    tiers = [CpuIsa.PORTABLE]
    for tier in list(CpuIsa)[1:]:
        if not _NEEDS[tier] <= have:
            break
        tiers.append(tier)
    return tuple(tiers)


@dataclass(frozen=True)
class TierChoice:
    """The tier a process runs its native kernels at, and why (for the log and /server_info)."""

    tier: CpuIsa
    best: CpuIsa  # the best tier this CPU executes
    capped: bool  # $RADIXSERVE_CPU_ISA chose a lower tier than the CPU's best

    def describe(self) -> str:
        """`avx2 (no AVX-512 on this CPU)`, `avx2 (capped by RADIXSERVE_CPU_ISA; the CPU has
        avx512_bf16)`, `amx (the CPU's best)`."""
        if self.capped:
            return f"{self.tier.value} (capped by {ENV_CPU_ISA}; the CPU has {self.best.value})"
        missing = {CpuIsa.PORTABLE: "no AVX2", CpuIsa.AVX2: "no AVX-512",
                   CpuIsa.AVX512: "no AVX512-BF16", CpuIsa.AVX512_BF16: "no AMX"}
        if not is_x86():
            return f"portable ({platform.machine()}: no x86 tiers)"
        why = missing.get(self.tier)
        return f"{self.tier.value} ({why} on this CPU)" if why else f"{self.tier.value}"


def parse_tier(name: str) -> CpuIsa:
    """A tier by name; CpuIsaError listing the names otherwise."""
    try:
        return CpuIsa(name.strip().lower())
    except ValueError:
        names = ", ".join(t.value for t in CpuIsa)
        raise CpuIsaError(f"{ENV_CPU_ISA}={name!r} names no CPU tier; use one of: {names}"
                          ) from None


def choose_tier(requested: str | None = None, flags: frozenset[str] | None = None
                ) -> TierChoice:
    """The best tier this CPU executes, capped by `requested` (default: $RADIXSERVE_CPU_ISA).
    A requested tier above the CPU's best raises CpuIsaError: its code would die on an
    illegal instruction."""
    best = host_tiers(flags)[-1]
    name = os.environ.get(ENV_CPU_ISA, "") if requested is None else requested
    if not name.strip():
        return TierChoice(best, best, capped=False)
    tier = parse_tier(name)
    if tier.rank > best.rank:
        raise CpuIsaError(
            f"{ENV_CPU_ISA}={tier.value} is above this CPU's best tier ({best.value}): its "
            f"code would stop on an illegal instruction; use {best.value} or lower")
    return TierChoice(tier, best, capped=tier != best)
