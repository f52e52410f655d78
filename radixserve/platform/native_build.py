"""Building one native CPU extension for one instruction-set tier with torch's loader.

Owns: `NativeExtension` (what an extension is: its sources, base flags and the ops it
registers), `build_extension(ext, tier)` (compile, or load the cached build of, one
(extension, tier) pair: once per process, and a failure once per machine; a cached build is
loaded directly, `load_cached`), and the failure markers. Does not know: which tier a process
runs, falling back between tiers, the table of extensions (platform/kernels.py), what the ops
compute.

A build's name carries its tier and a digest of its sources, the headers beside them and its
flags, so a changed header is a fresh build (no version to bump by hand) and a cache folder
shared between machines never hands one CPU another tier's binary. The C++ registers its ops
with `TORCH_LIBRARY_FRAGMENT(RADIXSERVE_OPS_NS, m)`; the build defines RADIXSERVE_OPS_NS as
`radixserve_<tier>` (cpu_isa.ops_namespace), so one process can load several tiers side by
side (the tests run every tier the host executes).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from radixserve.platform.cpu_isa import CpuIsa, march_flags, ops_namespace

logger = logging.getLogger(__name__)

# "1": build even where an earlier build with the same sources, flags and compiler failed
ENV_RETRY = "RADIXSERVE_RETRY_CPU_BUILD"
# -fopenmp on both steps: at::parallel_for is a header template whose `omp parallel` compiles
# away without it. The link needs libgomp.so.1, which resolves to the copy torch already
# loaded (the same soname): one OpenMP runtime, one thread pool, sized by torch.set_num_threads.
LDFLAGS = ("-fopenmp",)
# Loading a cached build takes well under this; longer means torch recompiled it.
REBUILD_NOTICE_S = 5.0


@dataclass(frozen=True)
class NativeExtension:
    """One C++ extension: built once per tier from the same sources."""

    name: str  # base of the build's name: radixserve_<what>
    sources: tuple[Path, ...]
    what: str  # for the log: "CPU attention kernels"
    ops: tuple[str, ...]  # the ops it registers (present once loaded)
    # compile flags besides the tier's -march (-ffast-math goes to the compile step only: a
    # link with it would add crtfastmath, flush-to-zero for the whole process)
    cflags: tuple[str, ...] = ("-O3", "-ffast-math", "-fopenmp")
    header_dirs: tuple[Path, ...] = ()  # other folders whose headers the sources include

    def flags(self, tier: CpuIsa) -> tuple[str, ...]:
        return (*self.cflags, *march_flags(tier), f"-DRADIXSERVE_OPS_NS={ops_namespace(tier)}")

    def headers(self) -> tuple[Path, ...]:
        folders = sorted({s.parent for s in self.sources} | set(self.header_dirs))
        return tuple(sorted(h for d in folders for h in d.glob("*.h")))

    def digest(self, tier: CpuIsa) -> str:
        """The sources, every header beside them, and the flags."""
        h = hashlib.sha256(self.name.encode())
        for path in (*self.sources, *self.headers()):
            h.update(path.name.encode())
            with contextlib.suppress(OSError):  # a missing source: the build reports it
                h.update(path.read_bytes())
        h.update(" ".join((*self.flags(tier), *LDFLAGS)).encode())
        return h.hexdigest()[:10]

    def full_name(self, tier: CpuIsa) -> str:
        return f"{self.name}_{tier.value}_{self.digest(tier)}"

    def registered(self, tier: CpuIsa) -> bool:
        ns = getattr(torch.ops, ops_namespace(tier))
        return all(hasattr(ns, op) for op in self.ops)


@dataclass(frozen=True)
class BuildOutcome:
    ok: bool
    error: str = ""  # the compiler's first error line, where it failed
    marker: Path | None = None  # where the failure is remembered
    before: bool = False  # the failure was remembered from an earlier process


def ninja_on_path() -> None:
    """torch runs `ninja` from PATH; the `ninja` wheel's binary is in the venv, which a
    `.venv/bin/python ...` run does not put on PATH."""
    try:
        import ninja
    except ImportError:
        return
    bin_dir = str(ninja.BIN_DIR)
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def cached_build(full_name: str) -> Path | None:
    """The built library of `full_name` if torch's build folder already holds it (then
    `load` only loads it), else None (the next `load` compiles it: seconds to minutes)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        folder = Path(_get_build_directory(full_name, verbose=False))
    except Exception:  # noqa: BLE001  a torch without the helper: report "not cached"
        return None
    library = folder / f"{full_name}.so"
    return library if library.is_file() else None


def load_cached(full_name: str) -> bool:
    """Load `full_name`'s cached library straight away; False where there is none, where
    another process holds its build folder's lock (building it: torch's `load` waits for
    that), or where it does not load. torch's `load` of a cached build writes a ninja file,
    checks the compiler and runs ninja to find nothing to do: most of a start's kernel
    loading. The name's digest already says the library was built from these sources,
    headers and flags."""
    library = cached_build(full_name)
    if library is None or (library.parent / "lock").exists():
        return False
    try:
        torch.ops.load_library(str(library))  # type: ignore[no-untyped-call]
    except OSError:
        return False
    return True


def compiler() -> Path | None:
    """The C++ compiler torch's loader runs ($CXX, else c++), resolved; None if not found."""
    found = shutil.which(os.environ.get("CXX") or "c++")
    return Path(found).resolve() if found else None


def failure_marker(ext: NativeExtension, tier: CpuIsa) -> Path:
    """Where a failed build is remembered across processes: per sources, headers, flags
    (full_name) and compiler (its path, size and mtime: not `--version`, whose run a broken
    compiler could make as slow as the build)."""
    key = ext.full_name(tier)
    cxx = compiler()
    if cxx is not None:
        st = cxx.stat()
        key += "-" + hashlib.sha256(f"{cxx}:{st.st_size}:{st.st_mtime_ns}".encode()
                                    ).hexdigest()[:8]
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or str(
        Path.home() / ".cache" / "torch_extensions")
    return Path(root) / "radixserve-failed-builds" / f"{key}.txt"


def first_error_line(message: str) -> str:
    """The compiler's first `error:` line in a failed build's output, else its first line."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in lines:
        if "error:" in line or "Error:" in line:
            return line[:300]
    return lines[0][:300] if lines else "no output"


def _remember_failure(marker: Path, first_error: str) -> None:
    """Write the marker atomically (another process may be reading it)."""
    with contextlib.suppress(OSError):
        marker.parent.mkdir(parents=True, exist_ok=True)
        tmp = marker.with_suffix(f".{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            f.write(first_error + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, marker)


@functools.cache
def build_extension(ext: NativeExtension, tier: CpuIsa) -> BuildOutcome:
    """Build (or load the cached build of) `ext` for `tier`; its ops then live in
    torch.ops.radixserve_<tier>. A failure is returned, not logged (the caller falls back and
    says so once), and remembered on disk; $RADIXSERVE_RETRY_CPU_BUILD=1 ignores the marker.
    A build (a machine's first start, or a changed kernel) is logged before and after, with
    its duration: it runs while the weights load and would otherwise look like a hang."""
    if ext.registered(tier):
        return BuildOutcome(ok=True)
    full_name = ext.full_name(tier)
    marker = failure_marker(ext, tier)
    if marker.is_file() and os.environ.get(ENV_RETRY) != "1":
        with contextlib.suppress(OSError):
            return BuildOutcome(False, marker.read_text().strip(), marker, before=True)
    building = cached_build(full_name) is None
    what = f"{ext.what} ({tier.value})"
    if building:
        logger.info("building the native %s (first start on this machine only; cached under "
                    "$TORCH_EXTENSIONS_DIR or ~/.cache/torch_extensions)", what)
    if not building and load_cached(full_name):
        return BuildOutcome(ok=True)
    start = time.perf_counter()
    try:
        from torch.utils.cpp_extension import load

        ninja_on_path()
        load(name=full_name, sources=[str(s) for s in ext.sources],
             extra_cflags=list(ext.flags(tier)), extra_ldflags=list(LDFLAGS),
             is_python_module=False, verbose=False)
    except Exception as e:  # noqa: BLE001  any build failure: the caller falls back
        first = f"{type(e).__name__}: {first_error_line(str(e))}"
        _remember_failure(marker, first)
        return BuildOutcome(False, first, marker)
    elapsed = time.perf_counter() - start
    if building:
        logger.info("built the native %s in %.1f s; later starts load the cached build",
                    what, elapsed)
    elif elapsed > REBUILD_NOTICE_S:
        logger.info("rebuilt the native %s in %.1f s", what, elapsed)
    return BuildOutcome(ok=True)
