"""The start-up log says when the native CPU kernels are being built (first start only) and
how long it took; a cached build loads silently. torch's compiler is replaced by a fake that
writes the library where torch would, so no C++ is compiled here."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch.utils.cpp_extension as cpp_extension

from radixserve.platform import native_build
from radixserve.platform.cpu_isa import CpuIsa
from radixserve.platform.native_build import NativeExtension


def test_first_build_is_logged_with_its_duration_and_a_cached_one_is_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    builds: list[str] = []

    def fake_load(name: str, **_: Any) -> None:
        builds.append(name)
        folder = Path(cpp_extension._get_build_directory(name, verbose=False))
        (folder / f"{name}.so").write_bytes(b"")

    monkeypatch.setattr(cpp_extension, "load", fake_load)
    ext = NativeExtension("radixserve_log_test", (tmp_path / "k.cpp",), "CPU test kernels",
                          ("rs_no_such_op",))
    native_build.build_extension.cache_clear()
    with caplog.at_level(logging.INFO, logger=native_build.__name__):
        assert native_build.build_extension(ext, CpuIsa.AVX2).ok
    first = [r.getMessage() for r in caplog.records]
    assert len(builds) == 1
    assert any("building the native CPU test kernels (avx2)" in m and "first start" in m
               for m in first), first
    assert any(m.startswith("built the native CPU test kernels (avx2) in ") for m in first), first
    caplog.clear()
    native_build.build_extension.cache_clear()  # a second process
    with caplog.at_level(logging.INFO, logger=native_build.__name__):
        assert native_build.build_extension(ext, CpuIsa.AVX2).ok
    assert len(builds) == 2  # torch's load still runs: it loads the cached library
    assert not [r for r in caplog.records if "build" in r.getMessage()]
