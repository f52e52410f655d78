"""`python -m radixserve.platform.kernels --check-builds` compiles every native extension for
every tier, whatever the host, and prints the extension x tier table: an AVX-512-only line in a
file the AVX2 or portable tier compiles fails it (and so CI) on any machine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from radixserve.platform import cpu_isa
from radixserve.platform.check_builds import (
    check_builds,
    compile_command,
    format_table,
    precompile_prelude,
    prelude_key,
)
from radixserve.platform.cpu_isa import CpuIsa
from radixserve.platform.kernels import EXTENSIONS
from radixserve.platform.native_build import NativeExtension, compiler

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler")

UNGUARDED = """#include <immintrin.h>
float total(const float* p) { return _mm512_reduce_add_ps(_mm512_loadu_ps(p)); }
"""
GUARDED = """#include <immintrin.h>
float total(const float* p) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(_mm512_loadu_ps(p));
#else
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += p[i];
  return s;
#endif
}
"""


def test_every_extension_compiles_for_every_tier() -> None:
    done = subprocess.run([sys.executable, "-m", "radixserve.platform.kernels",
                           "--check-builds"], capture_output=True, text=True, timeout=1800,
                          check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = done.stdout.splitlines()
    header = lines[0].split()
    assert header == ["extension", *(t.value for t in cpu_isa.buildable_tiers())]
    for ext in EXTENSIONS:
        (row,) = [line.split() for line in lines if line.split()[0] == ext.name]
        assert row[1:] == ["ok"] * (len(header) - 1), row


@pytest.mark.skipif(not cpu_isa.is_x86(), reason="the tiers are x86's")
def test_an_avx512_only_line_fails_the_lower_tiers(tmp_path: Path) -> None:
    """bad and good share a precompiled prelude per tier (the avx2 one declares no AVX-512);
    alone (its own flags) compiles bad without one."""
    bad, good = tmp_path / "bad.cpp", tmp_path / "good.cpp"
    bad.write_text(UNGUARDED)
    good.write_text(GUARDED)
    exts = (NativeExtension("rs_check_bad", (bad,), "test", ()),
            NativeExtension("rs_check_good", (good,), "test", ()),
            NativeExtension("rs_check_alone", (bad,), "test", (), cflags=("-O3",)))
    results = check_builds(exts, jobs=2, tiers=(CpuIsa.PORTABLE, CpuIsa.AVX2, CpuIsa.AVX512),
                           prelude=("immintrin.h",))
    ok = {(r.ext, r.tier): r.ok for r in results}
    assert ok == {(name, tier): tier is CpuIsa.AVX512 or name == "rs_check_good"
                  for name in ("rs_check_bad", "rs_check_good", "rs_check_alone")
                  for tier in (CpuIsa.PORTABLE, CpuIsa.AVX2, CpuIsa.AVX512)}
    table = format_table(results)
    assert "rs_check_bad @ avx2: bad.cpp:" in table and "target specific option mismatch" in table


@pytest.mark.skipif(not cpu_isa.is_x86(), reason="the tiers are x86's")
def test_the_precompiled_prelude_is_used_with_each_extensions_defines(tmp_path: Path) -> None:
    """gcc -H marks a .gch it uses with `!` (`x`: found but invalid, then it parses the header
    again): the prelude built without an extension's -D flags is valid for its sources."""
    source = tmp_path / "k.cpp"
    source.write_text(GUARDED)
    ext = NativeExtension("rs_check_pch", (source,), "test", ())
    cxx = str(compiler())
    key = prelude_key(ext, CpuIsa.AVX2)
    header = precompile_prelude(key, ("immintrin.h",), tmp_path / "p", cxx)
    assert header is not None
    cmd = compile_command(ext, CpuIsa.AVX2, source, tmp_path / "k.o", cxx, header)
    done = subprocess.run([*cmd, "-H"], capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert f"! {header}.gch" in done.stderr, done.stderr[:2000]
