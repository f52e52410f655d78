"""PageAllocator: alloc/free bookkeeping, exhaustion, misuse and the slot <-> page maps."""

from __future__ import annotations

import pytest

from radixserve.cache.page_allocator import PageAllocator


def num_used_pages(alloc: PageAllocator) -> int:
    return alloc.num_pages - alloc.num_free_pages


def test_alloc_takes_distinct_pages_until_exhausted() -> None:
    alloc = PageAllocator(num_pages=8, page_size=4)
    first = alloc.alloc(3)
    second = alloc.alloc(5)
    assert first == [0, 1, 2]
    assert second is not None and len(second) == 5
    assert set(first) | set(second) == set(range(8))
    assert alloc.num_free_pages == 0 and alloc.num_free_slots == 0
    assert num_used_pages(alloc) == 8
    alloc.check_integrity()


def test_alloc_is_all_or_nothing() -> None:
    alloc = PageAllocator(num_pages=4, page_size=2)
    assert alloc.alloc(3) is not None
    assert alloc.alloc(2) is None  # only one free: no partial allocation
    assert alloc.num_free_pages == 1
    assert alloc.alloc(0) == []
    assert alloc.alloc(1) is not None
    assert alloc.alloc(1) is None
    alloc.check_integrity()


def test_free_returns_pages_for_reuse() -> None:
    alloc = PageAllocator(num_pages=4, page_size=16)
    pages = alloc.alloc(4)
    assert pages is not None
    alloc.free(pages[1:3])
    assert alloc.num_free_pages == 2 and alloc.num_free_slots == 32
    again = alloc.alloc(2)
    assert again is not None and sorted(again) == sorted(pages[1:3])
    alloc.free(pages[:1] + pages[3:] + again)
    assert alloc.num_free_pages == 4
    alloc.check_integrity()


def test_double_free_and_foreign_ids_assert() -> None:
    alloc = PageAllocator(num_pages=4, page_size=1)
    pages = alloc.alloc(2)
    assert pages is not None
    alloc.free(pages[:1])
    with pytest.raises(AssertionError, match="double free"):
        alloc.free(pages[:1])
    with pytest.raises(AssertionError, match="out of range"):
        alloc.free([4])
    with pytest.raises(AssertionError, match="double free"):
        alloc.free([pages[1], pages[1]])


def test_bad_arguments_raise_value_error() -> None:
    with pytest.raises(ValueError):
        PageAllocator(num_pages=0, page_size=1)
    with pytest.raises(ValueError):
        PageAllocator(num_pages=1, page_size=0)
    with pytest.raises(ValueError):
        PageAllocator(num_pages=1, page_size=1).alloc(-1)


def test_check_integrity_detects_corruption() -> None:
    alloc = PageAllocator(num_pages=4, page_size=1)
    assert alloc.alloc(1) == [0]
    alloc._free_stack.append(1)  # page 1 is free already: now stacked twice
    with pytest.raises(AssertionError):
        alloc.check_integrity()
    alloc = PageAllocator(num_pages=4, page_size=1)
    assert alloc.alloc(1) == [0]
    alloc._is_free[0] = 1  # byte map says free, stack does not hold it
    with pytest.raises(AssertionError):
        alloc.check_integrity()


def test_pages_slots_round_trip() -> None:
    alloc = PageAllocator(num_pages=8, page_size=4)
    assert alloc.pages_to_slots([2, 0]) == [8, 9, 10, 11, 0, 1, 2, 3]
    assert alloc.slots_to_pages([8, 9, 10, 11, 0, 1, 2, 3]) == [2, 0]
    assert alloc.pages_to_slots([]) == [] and alloc.slots_to_pages([]) == []
    with pytest.raises(AssertionError):
        alloc.slots_to_pages([8, 9, 10])  # not whole pages
    with pytest.raises(AssertionError):
        alloc.slots_to_pages([9, 10, 11, 12])  # not page aligned
    with pytest.raises(AssertionError):
        alloc.slots_to_pages([8, 9, 11, 10])  # offsets out of order
    unit = PageAllocator(num_pages=8, page_size=1)
    assert unit.pages_to_slots([5, 3]) == [5, 3] and unit.slots_to_pages([5, 3]) == [5, 3]
