"""platform/huge_pages.py: the THP mode, the 2 MB spans, smaps parsing, and madvise over real
memory: advised where THP allows it, nothing done where it is `never`, file mappings left
alone."""

from __future__ import annotations

import dataclasses
import mmap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from radixserve.platform.huge_pages import (
    HUGE_PAGE,
    advise_huge,
    advised_huge,
    huge_bytes,
    huge_spans,
    read_smaps,
    thp_mode,
)

THP_ON = thp_mode() in ("always", "madvise")
needs_thp = pytest.mark.skipif(not THP_ON, reason="transparent huge pages off or not Linux")
needs_smaps = pytest.mark.skipif(not read_smaps(), reason="no /proc/self/smaps")


def test_thp_mode_reads_the_bracketed_choice(tmp_path: Path) -> None:
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert thp_mode(f) == "madvise"
    f.write_text("always madvise [never]\n")
    assert thp_mode(f) == "never"
    assert thp_mode(tmp_path / "absent") is None


def test_spans_round_out_to_2mb_and_merge() -> None:
    h = HUGE_PAGE
    assert huge_spans([(h + 5, 10)]) == [(h, h)]
    assert huge_spans([(h - 1, 2)]) == [(0, 2 * h)]  # straddles a boundary
    # overlapping after rounding: one span; a gap of a whole page: two; empty ranges dropped
    assert huge_spans([(3 * h + 1, 1), (h, 2 * h + 10), (8 * h, 0)]) == [(h, 3 * h)]
    assert huge_spans([(0, 1), (2 * h, 1)]) == [(0, h), (2 * h, h)]


def test_read_smaps_parses_paths_flags_and_huge_bytes(tmp_path: Path) -> None:
    f = tmp_path / "smaps"
    f.write_text(
        "00400000-00600000 r--p 00000000 fe:00 123    /usr/bin/python3\n"
        "Size:               2048 kB\nAnonHugePages:         0 kB\nVmFlags: rd mr mw me\n"
        "7f0000000000-7f0000800000 rw-p 00000000 00:00 0 \n"
        "Size:               8192 kB\nAnonHugePages:      4096 kB\n"
        "VmFlags: rd wr mr mw me ac hg\n"
        "7f0000800000-7f0000a00000 rw-p 00000000 00:00 0    [heap]\n"
        "AnonHugePages:         0 kB\nVmFlags: rd wr mr mw me ac\n")
    maps = read_smaps(f)
    assert [m.path for m in maps] == ["/usr/bin/python3", "", "[heap]"]
    assert [m.anonymous for m in maps] == [False, True, True]
    assert maps[1].anon_huge == 4 * 2**20 and "hg" in maps[1].flags
    ranges = [(0x7F0000000000 + 100, 3 * 2**20)]
    assert huge_bytes(ranges, maps) == 4 * 2**20
    assert advised_huge(ranges, maps)
    assert not advised_huge([(0x7F0000800000, 4096)], maps)
    assert not advised_huge([(0x7F0000700000, 2 * 2**20)], maps)  # runs into the heap
    both = [*maps[:2], dataclasses.replace(maps[2], flags=(*maps[2].flags, "hg"))]
    assert advised_huge([(0x7F0000700000, 2 * 2**20)], both)  # two adjacent advised ones


@pytest.fixture
def fresh() -> Iterator[torch.Tensor]:
    """16 MB of touched memory in a new private anonymous mapping: never advised before (heap
    memory may be, where an earlier engine's weights were freed)."""
    nbytes = 8 * HUGE_PAGE
    with mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as mm:
        x = torch.frombuffer(mm, dtype=torch.float32)
        x.fill_(1.0)
        yield x
        del x


@needs_smaps
def test_never_does_nothing(fresh: torch.Tensor) -> None:
    ranges = [(fresh.data_ptr(), fresh.numel() * 4)]
    advice = advise_huge(ranges, mode="never")
    assert advice.advised == 0 and not advice.collapsed and advice.error is None
    assert not advised_huge(ranges)


@needs_thp
def test_madvise_advises_and_collapses_anonymous_memory(fresh: torch.Tensor) -> None:
    ranges = [(fresh.data_ptr(), fresh.numel() * 4)]
    assert not advised_huge(ranges)
    advice = advise_huge(ranges)
    assert advice.advised >= 6 * HUGE_PAGE  # the mapping's aligned part at least
    assert advised_huge(ranges)
    if advice.collapsed:  # the kernel found free huge pages (not promised on a busy box)
        assert huge_bytes(ranges) >= 6 * HUGE_PAGE
    assert torch.equal(fresh, torch.ones_like(fresh))  # the contents survive the collapse


@needs_thp
def test_file_mappings_are_left_alone(tmp_path: Path) -> None:
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\1" * (4 * HUGE_PAGE))
    with f.open("r+b") as fh, mmap.mmap(fh.fileno(), 0, flags=mmap.MAP_PRIVATE) as mm:
        t = torch.frombuffer(mm, dtype=torch.uint8)
        ranges = [(t.data_ptr(), t.numel())]
        advice = advise_huge(ranges)
        assert advice.error == "file-backed" and not advice.collapsed
        assert not advised_huge(ranges)
        del t
