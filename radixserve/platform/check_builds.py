"""Compile every native extension for every tier, whatever the host: the extension x tier table.

Owns: `check_builds` (each source compiled to an object file in a temporary folder with the
tier's flags, in parallel; -O0: the preprocessor guards, the types and the intrinsics' target
checks are what differ between tiers, and gcc reports an intrinsic used outside its tier when
it inlines it, which -fsyntax-only skips) and `format_table`. Does not know: which tier runs,
loading (platform/kernels.py).

A (extension, tier) whose full build is already in torch's cache (the same sources, headers
and flags: native_build.NativeExtension.full_name) is reported as built without compiling
again: it compiled.
"""

from __future__ import annotations

import subprocess
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor
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
                    cxx: str) -> list[str]:
    """The loader's compile step for `source` (its defines, includes and the tier's flags),
    at -O0 and into `out`."""
    flags = [f for f in ext.flags(tier) if not f.startswith("-O")]
    return [cxx, f"-DTORCH_EXTENSION_NAME={ext.name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
            *_include_flags(), "-fPIC", "-std=c++20", *flags, "-O0", "-c", str(source),
            "-o", str(out)]


def _compile_one(cmd: list[str]) -> str | None:
    """None when it compiles, else the compiler's first error line."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}"
    return None if done.returncode == 0 else first_error_line(done.stderr + done.stdout)


def check_builds(extensions: tuple[NativeExtension, ...], jobs: int = 2,
                 tiers: tuple[CpuIsa, ...] | None = None) -> list[CheckResult]:
    """One result per (extension, tier), tiers lowest first."""
    cxx = compiler()
    tiers = buildable_tiers() if tiers is None else tiers
    pairs = [(ext, tier) for ext in extensions for tier in tiers]
    if cxx is None:
        return [CheckResult(e.name, t, False, "no C++ compiler ($CXX or c++)") for e, t in pairs]
    todo = [(e, t) for e, t in pairs if cached_build(e.full_name(t)) is None]
    with tempfile.TemporaryDirectory(prefix="radixserve-check-builds-") as tmp:
        jobs_list = [(e, t, s, compile_command(e, t, s, Path(tmp) / f"{e.name}-{t.value}-"
                                               f"{i}.o", str(cxx)))
                     for e, t in todo for i, s in enumerate(e.sources)]
        with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
            errors = list(pool.map(_compile_one, [j[3] for j in jobs_list]))
    first_error: dict[tuple[str, CpuIsa], str] = {}
    for (ext, tier, source, _), error in zip(jobs_list, errors, strict=True):
        if error is not None:
            first_error.setdefault((ext.name, tier), f"{source.name}: {error}")
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
