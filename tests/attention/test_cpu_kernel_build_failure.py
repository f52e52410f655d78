"""A failed native build is paid once: remembered on disk per sources, flags and compiler, so
the next start (a fresh process: the in-process cache cleared) skips it with one warning that
names the compiler's first error and how to retry. A real compiler that fails slowly (a script
as $CXX) shows the second start does not wait for it."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path
from typing import Any

import pytest
import torch.utils.cpp_extension as cpp_extension

from radixserve.platform import kernels, native_build
from radixserve.platform.cpu_isa import CpuIsa
from radixserve.platform.native_build import ENV_RETRY, NativeExtension


@pytest.fixture
def fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.delenv(ENV_RETRY, raising=False)
    _new_process()
    source = tmp_path / "k.cpp"
    source.write_text("int f() { return 0; }\n")
    yield source
    _new_process()


def _new_process() -> None:
    native_build.build_extension.cache_clear()
    kernels._load.cache_clear()


def _load(name: str, source: Path, tier: CpuIsa = CpuIsa.PORTABLE
          ) -> kernels.LoadedExtension | None:
    ext = NativeExtension(name, (source,), "CPU test kernels", ("rs_no_such_op",))
    return kernels.load_extension(ext, tier)


def _failing_load(calls: list[str]) -> Any:
    def load(name: str, **_: Any) -> None:
        calls.append(name)
        raise RuntimeError("Error building extension 'x':\n[1/2] c++ -c k.cpp\n"
                           "k.cpp:3:1: error: 'radixserve_vec' has not been declared\n"
                           "k.cpp:9:2: error: a later error\nninja: build stopped")
    return load


def test_a_failed_build_is_remembered_across_processes(
        fresh: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    calls: list[str] = []
    monkeypatch.setattr(cpp_extension, "load", _failing_load(calls))
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        assert not _load("rs_fail_test", fresh)
        # the same process: remembered without a second warning
        assert not _load("rs_fail_test", fresh)
    assert len(calls) == 1
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    assert "'radixserve_vec' has not been declared" in warnings[0]
    assert "a later error" not in warnings[0]
    assert ENV_RETRY in warnings[0]

    caplog.clear()
    _new_process()  # a second process
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        assert not _load("rs_fail_test", fresh)
    assert len(calls) == 1  # not compiled again
    (again,) = [r.getMessage() for r in caplog.records]
    assert "failed before" in again and "has not been declared" in again
    marker = next((Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "radixserve-failed-builds")
                  .iterdir())
    assert str(marker) in again

    # a changed source is a new build; so is the retry switch
    _new_process()
    fresh.write_text("int f() { return 1; }\n")
    assert not _load("rs_fail_test", fresh)
    assert len(calls) == 2
    _new_process()
    monkeypatch.setenv(ENV_RETRY, "1")
    assert not _load("rs_fail_test", fresh)
    assert len(calls) == 3


def test_a_slow_broken_compiler_is_paid_by_the_first_start_only(
        fresh: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = tmp_path / "runs.txt"
    cxx = tmp_path / "slow-cxx"
    cxx.write_text(f"#!/bin/sh\necho run >> {runs}\nsleep 1\n"
                   "echo 'fake.cpp:1:1: error: this compiler is broken' >&2\nexit 1\n")
    cxx.chmod(cxx.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(cxx))
    assert not _load("rs_slow_cxx_test", fresh)
    paid = runs.read_text().count("run")
    assert paid >= 1
    _new_process()  # the second start
    assert not _load("rs_slow_cxx_test", fresh)
    assert runs.read_text().count("run") == paid  # the compiler was not run again


def test_a_failed_tier_falls_back_to_the_next_lower_tier_that_builds(
        fresh: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    calls: list[str] = []

    def load(name: str, **_: Any) -> None:
        calls.append(name)
        if "_avx512" in name:  # avx512 and avx512_bf16: a line their -march rejects
            raise RuntimeError(f"Error building extension:\nk.cpp:1:1: error: in {name}")

    monkeypatch.setattr(cpp_extension, "load", load)
    with caplog.at_level(logging.WARNING, logger=kernels.__name__):
        loaded = _load("rs_tier_test", fresh, CpuIsa.AVX512_BF16)
        assert _load("rs_tier_test", fresh, CpuIsa.AVX512_BF16) == loaded  # once a process
    assert loaded is not None and loaded.tier is CpuIsa.AVX2
    assert [c.split("_")[3] for c in calls] == ["avx512", "avx512", "avx2"]
    (warning,) = [r.getMessage() for r in caplog.records]
    assert "unavailable at avx512_bf16" in warning and "running its avx2 build" in warning
    _new_process()  # the next start goes straight to the tier that builds
    assert _load("rs_tier_test", fresh, CpuIsa.AVX512_BF16) == loaded
    assert len(calls) == 4


def test_a_broken_toolchain_stops_after_two_tiers(fresh: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    monkeypatch.setattr(cpp_extension, "load", _failing_load(calls))
    assert _load("rs_toolchain_test", fresh, CpuIsa.AMX) is None
    assert len(calls) == 2  # the same first error at amx and avx512_bf16: not the tier's code
