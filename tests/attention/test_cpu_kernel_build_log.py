"""The start-up log says when the native CPU kernels are being built (first start only) and
how long it took; a cached build loads silently, without torch's `load` (its ninja run). torch's
loader is replaced by a fake that writes a tiny real library where torch would, so none of the
kernels' C++ is compiled here."""

from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.utils.cpp_extension as cpp_extension

from radixserve.platform import native_build
from radixserve.platform.cpu_isa import CpuIsa
from radixserve.platform.native_build import NativeExtension


def test_first_build_is_logged_with_its_duration_and_a_cached_one_is_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    cxx = native_build.compiler()
    if cxx is None:
        pytest.skip("no C++ compiler")
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    builds: list[str] = []

    def fake_load(name: str, **_: Any) -> None:
        builds.append(name)
        folder = Path(cpp_extension._get_build_directory(name, verbose=False))
        subprocess.run([str(cxx), "-shared", "-fPIC", "-x", "c++", "-", "-o",
                        str(folder / f"{name}.so")], input=b"int rs_log_test() { return 1; }",
                       check=True)

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
    assert len(builds) == 1  # the cached library is loaded as it is: no torch load, no ninja
    library = native_build.cached_build(ext.full_name(CpuIsa.AVX2))
    assert library is not None and os.path.realpath(library) in torch.ops.loaded_libraries
    assert not [r for r in caplog.records if "build" in r.getMessage()]
    # Another process building it (torch's lock in its folder): torch's load, which waits
    native_build.build_extension.cache_clear()
    (library.parent / "lock").touch()
    assert native_build.build_extension(ext, CpuIsa.AVX2).ok
    assert len(builds) == 2
