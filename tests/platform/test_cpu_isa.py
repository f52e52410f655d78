"""The CPU tier a process runs: the best the CPU executes, capped by $RADIXSERVE_CPU_ISA, a
cap above the CPU refused with a clear error; each tier's flags are what its -march needs.
CPUs are given as /proc/cpuinfo flag sets: AVX2-only, AVX-512, AVX512-BF16 and AMX parts."""

from __future__ import annotations

import pytest

from radixserve.platform import cpu_isa
from radixserve.platform.cpu_isa import ENV_CPU_ISA, CpuIsa, CpuIsaError, choose_tier, host_tiers

AVX2 = frozenset("sse4_2 avx avx2 fma f16c bmi1 bmi2 abm movbe".split())  # EPYC Rome/Milan
AVX512 = AVX2 | frozenset("avx512f avx512bw avx512cd avx512dq avx512vl".split())  # Skylake-SP
BF16 = AVX512 | frozenset("avx512_bf16 avx512vbmi avx512_vnni".split())  # Zen 4
AMX = BF16 | frozenset("amx_tile amx_bf16 amx_int8".split())  # Sapphire Rapids


@pytest.fixture(autouse=True)
def _x86(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_isa, "is_x86", lambda: True)
    monkeypatch.delenv(ENV_CPU_ISA, raising=False)


@pytest.mark.parametrize(("flags", "best"), [
    (frozenset({"sse2"}), CpuIsa.PORTABLE), (AVX2, CpuIsa.AVX2), (AVX512, CpuIsa.AVX512),
    (BF16, CpuIsa.AVX512_BF16), (AMX, CpuIsa.AMX),
    (AVX2 - {"fma"}, CpuIsa.PORTABLE),  # AVX2 without FMA is not x86-64-v3
    (AVX2 | frozenset({"amx_tile", "amx_bf16", "amx_int8"}), CpuIsa.AVX2),  # tiers stack
])
def test_the_best_tier_is_the_highest_whose_flags_and_lower_tiers_flags_the_cpu_has(
        flags: frozenset[str], best: CpuIsa) -> None:
    tiers = host_tiers(flags)
    assert tiers[-1] is best
    assert tiers == tuple(t for t in CpuIsa if t.rank <= best.rank)


def test_the_start_line_names_the_tier_and_why() -> None:
    assert choose_tier(flags=AVX2).describe() == "avx2 (no AVX-512 on this CPU)"
    assert choose_tier(flags=AVX512).describe() == "avx512 (no AVX512-BF16 on this CPU)"
    assert choose_tier(flags=BF16).describe() == "avx512_bf16 (no AMX on this CPU)"
    assert choose_tier(flags=AMX).describe() == "amx"
    capped = choose_tier("avx2", flags=AMX)
    assert capped.tier is CpuIsa.AVX2 and capped.capped
    assert capped.describe() == f"avx2 (capped by {ENV_CPU_ISA}; the CPU has amx)"


def test_the_environment_caps_the_tier(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_CPU_ISA, "avx2")
    assert choose_tier(flags=BF16).tier is CpuIsa.AVX2
    monkeypatch.setenv(ENV_CPU_ISA, "PORTABLE")
    assert choose_tier(flags=BF16).tier is CpuIsa.PORTABLE
    monkeypatch.setenv(ENV_CPU_ISA, "avx512_bf16")
    assert not choose_tier(flags=BF16).capped


def test_a_tier_above_the_cpu_or_an_unknown_name_is_refused(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_CPU_ISA, "avx512")
    with pytest.raises(CpuIsaError, match=r"avx512 is above this CPU's best tier \(avx2\)"):
        choose_tier(flags=AVX2)
    monkeypatch.setenv(ENV_CPU_ISA, "avx3")
    with pytest.raises(CpuIsaError, match="names no CPU tier; use one of: portable, avx2"):
        choose_tier(flags=AMX)


def test_each_tier_builds_for_its_own_march_and_op_namespace() -> None:
    assert cpu_isa.march_flags(CpuIsa.AVX2) == ("-march=x86-64-v3",)
    assert cpu_isa.march_flags(CpuIsa.AVX512)[0] == "-march=x86-64-v4"
    assert "-mavx512bf16" in cpu_isa.march_flags(CpuIsa.AVX512_BF16)
    assert "-mamx-bf16" in cpu_isa.march_flags(CpuIsa.AMX)
    assert not any("native" in f for t in CpuIsa for f in cpu_isa.march_flags(t))
    assert len({cpu_isa.ops_namespace(t) for t in CpuIsa}) == len(CpuIsa)


def test_off_x86_only_portable_exists(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_isa, "is_x86", lambda: False)
    assert host_tiers(AMX) == (CpuIsa.PORTABLE,)
    assert cpu_isa.buildable_tiers() == (CpuIsa.PORTABLE,)
    assert cpu_isa.march_flags(CpuIsa.PORTABLE) == ()
    assert choose_tier().tier is CpuIsa.PORTABLE
