"""Transparent huge pages (2 MB) for long-lived memory that is read in full every step.

Owns: reading the kernel's THP mode, `advise_huge` (madvise MADV_HUGEPAGE, then MADV_COLLAPSE,
over address ranges rounded out to 2 MB) and `huge_bytes` (how much of those ranges the
kernel backs with huge pages, from /proc/self/smaps). Does not know: torch, models (the
caller passes address ranges: model/weight_memory.py for the weights, the decode-floor bench
for its bandwidth buffer).

Why: a CPU decode step streams every weight once; with 4 KB pages that is one TLB miss (and a
page walk) per 4 KB read, which the hardware prefetchers cannot hide across page boundaries.
With 2 MB pages a sum over 1 GiB reads ~30 -> ~50 GB/s on the Zen 4 box (bench/README.md,
"Decode at the memory floor"). glibc's heap (the engine keeps every block there:
platform/cpu_malloc.py) is not madvised, so under THP `madvise` (the common default) weights
sit in 4 KB pages unless someone asks.

Rounding out to 2 MB covers a neighbour's bytes at each end of a range: harmless (the same
memory, now in a huge page). MADV_COLLAPSE (Linux 6.1+) copies the range's resident pages into
huge pages now; on older kernels it fails with EINVAL and MADV_HUGEPAGE alone lets khugepaged
collapse the range later. Nothing happens off Linux, where THP is `never`, or where the
sysfs file is absent (a kernel without THP).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import platform
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

HUGE_PAGE = 2 * 2**20  # x86-64 and arm64 (4 KB base pages): the PMD size
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
SMAPS = Path("/proc/self/smaps")
MADV_HUGEPAGE = 14  # Linux's asm-generic/mman-common.h
MADV_COLLAPSE = 25

Range = tuple[int, int]  # (address, bytes)


@dataclass(frozen=True)
class HugePageAdvice:
    """What `advise_huge` did: `mode` the kernel's THP setting (None: not Linux or no THP);
    `advised` bytes madvised (the ranges rounded out to 2 MB); `collapsed` whether
    MADV_COLLAPSE succeeded on every range; `error` the first errno's name, if any."""

    mode: str | None
    advised: int = 0
    collapsed: bool = False
    error: str | None = None


def thp_mode(path: Path = THP_ENABLED) -> str | None:
    """The bracketed choice of the THP sysfs file ("always", "madvise", "never"); None off
    Linux or where the file is missing or unreadable."""
    if platform.system() != "Linux":
        return None
    try:
        text = path.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def huge_spans(ranges: Iterable[Range]) -> list[Range]:
    """The ranges rounded out to HUGE_PAGE boundaries, sorted and merged: (start, bytes)."""
    spans = sorted((a // HUGE_PAGE * HUGE_PAGE, -(-(a + n) // HUGE_PAGE) * HUGE_PAGE)
                   for a, n in ranges if n > 0)
    merged: list[list[int]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e - s) for s, e in merged]


def _madvise() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def _errno_name() -> str:
    import errno

    code = ctypes.get_errno()
    return errno.errorcode.get(code, str(code))


@dataclass(frozen=True)
class Mapping:
    """One /proc/self/smaps entry: [start, end), its AnonHugePages bytes, its VmFlags."""

    start: int
    end: int
    anon_huge: int
    flags: tuple[str, ...]
    path: str = ""  # the mapped file, "[heap]", "[stack]", ... or "" (anonymous)

    @property
    def anonymous(self) -> bool:
        return self.path in ("", "[heap]")


def read_smaps(path: Path = SMAPS) -> list[Mapping]:
    """The process's mappings (empty where smaps is absent: not Linux)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return []
    out: list[Mapping] = []
    start = end = huge = 0
    name = ""
    for line in lines:
        fields = line.split(None, 5)
        head = fields[0] if fields else ""
        if "-" in head and not head.endswith(":"):  # "7f..-7f.. rw-p 0 00:00 0 [path]"
            a, b = head.split("-")
            start, end, huge = int(a, 16), int(b, 16), 0
            name = fields[5].strip() if len(fields) > 5 else ""
        elif head == "AnonHugePages:":
            huge = int(fields[1]) * 1024
        elif head == "VmFlags:":
            out.append(Mapping(start, end, huge, tuple(line.split()[1:]), name))
    return out


def huge_bytes(ranges: Sequence[Range], maps: Sequence[Mapping] | None = None) -> int:
    """AnonHugePages of the mappings advised huge ("hg") that overlap the ranges' 2 MB spans.
    Exact where the spans are whole mappings, as madvise leaves them (a mapping splits at a
    change of flags); a neighbour advised by someone else and merged with them counts too."""
    spans = huge_spans(ranges)
    maps = read_smaps() if maps is None else maps
    return sum(m.anon_huge for m in maps if "hg" in m.flags
               and any(s < m.end and m.start < s + n for s, n in spans))


def advised_huge(ranges: Sequence[Range], maps: Sequence[Mapping] | None = None) -> bool:
    """Whether every byte of the ranges lies in mappings madvised MADV_HUGEPAGE (a range may
    span several adjacent ones: the kernel splits a mapping where another flag differs)."""
    maps = read_smaps() if maps is None else maps
    hg = sorted((m.start, m.end) for m in maps if "hg" in m.flags)
    for a, n in ranges:
        at = a
        for s, e in hg:
            if s <= at < e:
                at = e
        if n > 0 and at < a + n:
            return False
    return True


def _pieces(spans: Sequence[Range], maps: Sequence[Mapping]) -> tuple[list[Range], int]:
    """The spans cut to the anonymous mappings they overlap (a span rounded out past its
    mapping's end would make madvise fail with ENOMEM), and the bytes of the spans that lie in
    file-backed mappings (left alone: their page cache is not ours to collapse)."""
    pieces: list[Range] = []
    file_bytes = 0
    for s, n in spans:
        for m in maps:
            a, b = max(s, m.start), min(s + n, m.end)
            if a >= b:
                continue
            if m.anonymous:
                pieces.append((a, b - a))
            else:
                file_bytes += b - a
    return pieces, file_bytes


def advise_huge(ranges: Iterable[Range], mode: str | None = None,
                maps: Sequence[Mapping] | None = None) -> HugePageAdvice:
    """Ask the kernel to back the ranges' anonymous memory (a heap, an anonymous mmap) with
    huge pages, and collapse what is resident into them now. `mode` overrides the sysfs THP
    mode (tests). Harmless where THP is off: nothing is called."""
    mode = thp_mode() if mode is None else mode
    if mode not in ("always", "madvise"):
        return HugePageAdvice(mode)
    madvise = _madvise()
    if madvise is None:
        return HugePageAdvice(mode, error="no madvise")
    pieces, file_bytes = _pieces(huge_spans(ranges), read_smaps() if maps is None else maps)
    advised, collapsed = 0, bool(pieces)
    error = "file-backed" if file_bytes else None
    for start, size in pieces:
        if madvise(start, size, MADV_HUGEPAGE) != 0:
            error, collapsed = error or _errno_name(), False
            continue
        advised += size
        # only whole 2 MB pages collapse: the piece rounded in
        a, b = -(-start // HUGE_PAGE) * HUGE_PAGE, (start + size) // HUGE_PAGE * HUGE_PAGE
        if b > a and madvise(a, b - a, MADV_COLLAPSE) != 0:  # EINVAL before Linux 6.1;
            error, collapsed = error or _errno_name(), False  # EAGAIN/ENOMEM: no huge page
    return HugePageAdvice(mode, advised, collapsed and not file_bytes, error)
