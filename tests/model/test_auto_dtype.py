"""`--dtype auto` (model/auto_dtype.py): the rule over CPU flags and the start-up measurement."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from radixserve.config import ConfigError, EngineConfig
from radixserve.engine.model_runner import resolve_device_dtype
from radixserve.model.auto_dtype import choose_auto_dtype, cpu_flags, measure_bf16_speedup
from radixserve.platform.cpu_isa import CpuIsa, TierChoice

CPU = torch.device("cpu")


def never() -> float:
    raise AssertionError("no measurement expected")


def test_cuda_and_amx_pick_bf16_without_measuring() -> None:
    c = choose_auto_dtype(torch.device("cuda"), frozenset(), never)
    assert c.dtype == torch.bfloat16 and c.describe() == "dtype auto -> bfloat16: CUDA device"
    c = choose_auto_dtype(CPU, frozenset({"avx512f", "amx_bf16", "avx512_bf16"}), never)
    assert c.dtype == torch.bfloat16 and "AMX" in c.reason


def test_avx2_only_picks_fp32_without_measuring() -> None:
    c = choose_auto_dtype(CPU, frozenset({"avx", "avx2", "fma"}), never)
    assert c.dtype == torch.float32
    assert c.describe().startswith("dtype auto -> float32: CPU has neither amx_bf16 nor")


@pytest.mark.parametrize(("speedup", "dtype", "reason"), [
    (2.3, torch.bfloat16, "CPU has avx512_bf16, bf16 matmul 2.3x fp32 measured"),
    (1.2, torch.bfloat16, "CPU has avx512_bf16, bf16 matmul 1.2x fp32 measured"),
    (0.9, torch.float32, "CPU has avx512_bf16 but bf16 matmul only 0.90x fp32 measured (< 1.2x)"),
    (0.0, torch.float32, "CPU has avx512_bf16 but bf16 matmul only 0.00x fp32 measured (< 1.2x)"),
])
def test_avx512_bf16_without_amx_follows_the_measurement(speedup: float, dtype: torch.dtype,
                                                         reason: str) -> None:
    c = choose_auto_dtype(CPU, frozenset({"avx512f", "avx512_bf16"}), lambda: speedup)
    assert (c.dtype, c.reason) == (dtype, reason)


def test_cpu_flags_reads_the_first_flags_line(tmp_path: Path) -> None:
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512_bf16\n\nflags\t\t: other\n")
    assert cpu_flags(str(f)) == frozenset({"fpu", "avx2", "avx512_bf16"})
    assert cpu_flags(str(tmp_path / "missing")) == frozenset()


def test_measurement_restores_the_thread_count() -> None:
    before = torch.get_num_threads()
    assert measure_bf16_speedup() >= 0.0
    assert torch.get_num_threads() == before


def test_runner_logs_the_choice(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="radixserve.engine.model_runner"):
        device, dtype = resolve_device_dtype(EngineConfig(dtype="auto", device="cpu"))
    assert device == CPU and dtype in (torch.float32, torch.bfloat16)
    line = f"dtype auto -> {str(dtype).removeprefix('torch.')}: "
    assert any(r.getMessage().startswith(line) for r in caplog.records)
    assert resolve_device_dtype(EngineConfig(dtype="float32", device="cpu"))[1] == torch.float32


AMX_FLAGS = frozenset({"avx512f", "avx512_bf16", "amx_bf16"})


@pytest.mark.parametrize(("tier", "dtype"), [
    (CpuIsa.PORTABLE, torch.float32), (CpuIsa.AVX2, torch.float32),
    (CpuIsa.AVX512, torch.float32), (CpuIsa.AVX512_BF16, torch.bfloat16),
])
def test_a_cpu_isa_cap_picks_what_that_cpu_would(tier: CpuIsa, dtype: torch.dtype) -> None:
    """RADIXSERVE_CPU_ISA=avx2 on an AMX machine runs as an AVX2 machine: fp32, as CI's."""
    capped = TierChoice(tier, CpuIsa.AMX, capped=True)
    c = choose_auto_dtype(CPU, AMX_FLAGS, lambda: 2.0, tier=capped)
    assert c.dtype == dtype
    if dtype == torch.float32:
        assert c.reason.endswith(f"(kernels capped at {tier.value} by RADIXSERVE_CPU_ISA)")
    else:  # amx hidden, avx512_bf16 kept: the measurement decides
        assert c.reason == "CPU has avx512_bf16, bf16 matmul 2.0x fp32 measured"
    uncapped = TierChoice(CpuIsa.AMX, CpuIsa.AMX, capped=False)
    assert choose_auto_dtype(CPU, AMX_FLAGS, never, tier=uncapped).dtype == torch.bfloat16


def test_the_runner_applies_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXSERVE_CPU_ISA", "portable")
    assert resolve_device_dtype(EngineConfig(dtype="auto", device="cpu"))[1] == torch.float32
    monkeypatch.setenv("RADIXSERVE_CPU_ISA", "no-such-tier")
    with pytest.raises(ConfigError, match="names no CPU tier"):
        resolve_device_dtype(EngineConfig(dtype="auto", device="cpu"))
