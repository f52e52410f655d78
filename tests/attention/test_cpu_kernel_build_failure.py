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

from radixserve.attention import cpu_kernels


@pytest.fixture
def fresh(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.delenv(cpu_kernels.ENV_RETRY, raising=False)
    cpu_kernels.build_extension.cache_clear()
    source = tmp_path / "k.cpp"
    source.write_text("int f() { return 0; }\n")
    yield source
    cpu_kernels.build_extension.cache_clear()


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
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert not cpu_kernels.build_extension("rs_fail_test", (fresh,), "CPU test kernels")
        # the same process: remembered without a second warning
        assert not cpu_kernels.build_extension("rs_fail_test", (fresh,), "CPU test kernels")
    assert len(calls) == 1
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1, warnings
    assert "'radixserve_vec' has not been declared" in warnings[0]
    assert "a later error" not in warnings[0]
    assert cpu_kernels.ENV_RETRY in warnings[0]

    caplog.clear()
    cpu_kernels.build_extension.cache_clear()  # a second process
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert not cpu_kernels.build_extension("rs_fail_test", (fresh,), "CPU test kernels")
    assert len(calls) == 1  # not compiled again
    (again,) = [r.getMessage() for r in caplog.records]
    assert "failed before" in again and "has not been declared" in again
    marker = next((Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "radixserve-failed-builds")
                  .iterdir())
    assert str(marker) in again

    # a changed source is a new build; so is the retry switch
    cpu_kernels.build_extension.cache_clear()
    fresh.write_text("int f() { return 1; }\n")
    assert not cpu_kernels.build_extension("rs_fail_test", (fresh,), "CPU test kernels")
    assert len(calls) == 2
    cpu_kernels.build_extension.cache_clear()
    monkeypatch.setenv(cpu_kernels.ENV_RETRY, "1")
    assert not cpu_kernels.build_extension("rs_fail_test", (fresh,), "CPU test kernels")
    assert len(calls) == 3


def test_a_slow_broken_compiler_is_paid_by_the_first_start_only(
        fresh: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runs = tmp_path / "runs.txt"
    cxx = tmp_path / "slow-cxx"
    cxx.write_text(f"#!/bin/sh\necho run >> {runs}\nsleep 1\n"
                   "echo 'fake.cpp:1:1: error: this compiler is broken' >&2\nexit 1\n")
    cxx.chmod(cxx.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CXX", str(cxx))
    assert not cpu_kernels.build_extension("rs_slow_cxx_test", (fresh,), "CPU test kernels")
    paid = runs.read_text().count("run")
    assert paid >= 1
    cpu_kernels.build_extension.cache_clear()  # the second start
    assert not cpu_kernels.build_extension("rs_slow_cxx_test", (fresh,), "CPU test kernels")
    assert runs.read_text().count("run") == paid  # the compiler was not run again
