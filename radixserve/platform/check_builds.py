"""Compile every native extension for every tier, whatever the host: the extension x tier table.

Owns: `check_builds` (each source compiled to an object file in a temporary folder with the
tier's flags, in parallel; -O0: the preprocessor guards, the types and the intrinsics' target
checks are what differ between tiers, and gcc reports an intrinsic used outside its tier when
it inlines it, which -fsyntax-only skips) and `format_table`. Does not know: which tier runs,
loading (platform/kernels.py).

A (extension, tier) whose full build is already in torch's cache (the same sources, headers
and flags: native_build.NativeExtension.full_name) is reported as built without compiling
again: it compiled.

Most of an -O0 compile is parsing torch's headers. `prelude` names headers every source
includes (ATen/ATen.h for the EXTENSIONS): they are precompiled once per tier and flags, and
each source of that tier is compiled with `-include` of it (gcc uses the .gch; where it
cannot, -Winvalid-pch says why and it parses the header as before, so only the time differs).
A prelude that does not compile is not used: the sources then report their own errors.
"""

from __future__ import annotations

import subprocess
import sysconfig
import tempfile
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from radixserve.platform.cpu_isa import CpuIsa, buildable_tiers
from radixserve.platform.native_build import (
    NativeExtension,
    cached_build,
    compiler,
    first_error_line,
)

COMPILE_TIMEOUT_S = 600


@dataclass(frozen=True)
class CheckResult:
    ext: str
    tier: CpuIsa
    ok: bool
    how: str  # "compiled", "built" (its full build is cached), or the first error line


def _include_flags() -> list[str]:
    from torch.utils.cpp_extension import include_paths

    paths = [*include_paths(), sysconfig.get_paths()["include"]]
    return [f for p in paths for f in ("-isystem", str(p))]


def compile_command(ext: NativeExtension, tier: CpuIsa, source: Path, out: Path,
                    cxx: str, prelude: Path | None = None) -> list[str]:
    """The loader's compile step for `source` (its defines, includes and the tier's flags),
    at -O0 and into `out`; `prelude`: a precompiled header to include first."""
    pch = [] if prelude is None else ["-include", str(prelude), "-Winvalid-pch"]
    return [cxx, f"-DTORCH_EXTENSION_NAME={ext.name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
            *_include_flags(), "-fPIC", "-std=c++20", *_tier_flags(ext, tier), "-O0", *pch,
            "-c", str(source), "-o", str(out)]


def _tier_flags(ext: NativeExtension, tier: CpuIsa) -> list[str]:
    return [f for f in ext.flags(tier) if not f.startswith("-O")]


def prelude_key(ext: NativeExtension, tier: CpuIsa) -> tuple[str, ...]:
    """What a precompiled prelude must be built with to serve `ext` at `tier`: the flags
    without the extension's own defines (which torch's headers do not read)."""
    return tuple(f for f in _tier_flags(ext, tier) if not f.startswith("-D"))


def precompile_prelude(key: tuple[str, ...], prelude: tuple[str, ...], folder: Path,
                       cxx: str) -> Path | None:
    """`prelude`'s headers precompiled with `key`'s flags: the header to -include (its .gch
    beside it), or None where that does not compile."""
    folder.mkdir()
    header = folder / "prelude.h"
    header.write_text("".join(f"#include <{h}>\n" for h in prelude))
    cmd = [cxx, "-DTORCH_API_INCLUDE_EXTENSION_H", *_include_flags(), "-fPIC", "-std=c++20",
           *key, "-O0", "-x", "c++-header", str(header), "-o", f"{header}.gch"]
    return header if _compile_one(cmd) is None else None


def _compile_one(cmd: list[str]) -> str | None:
    """None when it compiles, else the compiler's first error line."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}"
    return None if done.returncode == 0 else first_error_line(done.stderr + done.stdout)


def _compile_all(todo: list[tuple[NativeExtension, CpuIsa]], jobs: int, cxx: str,
                 prelude: tuple[str, ...], tmp: Path) -> dict[tuple[str, CpuIsa], str]:
    """Every source of `todo` compiled; the first error of each (extension, tier) that failed.
    Queued in order: the shared preludes, the sources that use none, then the others (each
    waits for its prelude, which by then has had the time of the sources before it)."""
    sources = [(e, t, i, s) for e, t in todo for i, s in enumerate(e.sources)]
    counts = Counter(prelude_key(e, t) for e, t, _, _ in sources)
    keys = [k for k, n in counts.items() if n >= 2] if prelude else []  # one source: no gain

    def run(k: int) -> str | None:
        ext, tier, i, source = sources[k]
        fut = headers.get(prelude_key(ext, tier))
        return _compile_one(compile_command(ext, tier, source,
                                            tmp / f"{ext.name}-{tier.value}-{i}.o", cxx,
                                            None if fut is None else fut.result()))

    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        headers: dict[tuple[str, ...], Future[Path | None]] = {
            key: pool.submit(precompile_prelude, key, prelude, tmp / f"prelude{n}", cxx)
            for n, key in enumerate(keys)}
        order = sorted(range(len(sources)),
                       key=lambda k: prelude_key(*sources[k][:2]) in headers)
        futures = {k: pool.submit(run, k) for k in order}
        errors = [futures[k].result() for k in range(len(sources))]
    first_error: dict[tuple[str, CpuIsa], str] = {}
    for (ext, tier, _, source), error in zip(sources, errors, strict=True):
        if error is not None:
            first_error.setdefault((ext.name, tier), f"{source.name}: {error}")
    return first_error


def check_builds(extensions: tuple[NativeExtension, ...], jobs: int = 2,
                 tiers: tuple[CpuIsa, ...] | None = None,
                 prelude: tuple[str, ...] = ()) -> list[CheckResult]:
    """One result per (extension, tier), tiers lowest first. `prelude`: headers every source
    includes, precompiled per tier (see the module's docstring)."""
    cxx = compiler()
    tiers = buildable_tiers() if tiers is None else tiers
    pairs = [(ext, tier) for ext in extensions for tier in tiers]
    if cxx is None:
        return [CheckResult(e.name, t, False, "no C++ compiler ($CXX or c++)") for e, t in pairs]
    todo = [(e, t) for e, t in pairs if cached_build(e.full_name(t)) is None]
    with tempfile.TemporaryDirectory(prefix="radixserve-check-builds-") as tmp:
        first_error = _compile_all(todo, jobs, str(cxx), prelude, Path(tmp))
    results = []
    for ext, tier in pairs:
        if (ext, tier) not in todo:
            results.append(CheckResult(ext.name, tier, True, "built"))
            continue
        error = first_error.get((ext.name, tier))
        results.append(CheckResult(ext.name, tier, error is None, error or "compiled"))
    return results


def format_table(results: list[CheckResult]) -> str:
    """Extensions as rows, tiers as columns (ok / FAIL), then each failure's first error."""
    tiers = sorted({r.tier for r in results}, key=lambda t: t.rank)
    names = list(dict.fromkeys(r.ext for r in results))
    by = {(r.ext, r.tier): r for r in results}
    width = max((len(n) for n in names), default=9)
    lines = ["extension".ljust(width) + "".join(f"  {t.value:>11}" for t in tiers)]
    for name in names:
        cells = "".join(f"  {'ok' if by[(name, t)].ok else 'FAIL':>11}" for t in tiers)
        lines.append(name.ljust(width) + cells)
    lines += [f"{r.ext} @ {r.tier.value}: {r.how}" for r in results if not r.ok]
    return "\n".join(lines)
