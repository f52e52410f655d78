"""PageAllocator: which KV pages are free.

Owns only the free list of page ids in [0, num_pages) and the slot <-> page arithmetic
(slot = page * page_size + offset). It does not know who holds a used page (the radix tree
or a running request) nor anything about the K/V tensors; the caller keeps the books
`free + cached + held == total`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt


def whole_pages(slots: npt.NDArray[np.integer[Any]], page_size: int) -> npt.NDArray[np.int64]:
    """The page id of each page in `slots`; AssertionError unless `slots` are whole pages,
    each starting on a page boundary with its offsets in order (page_size > 1)."""
    assert len(slots) % page_size == 0, f"{len(slots)} slots are not whole pages of {page_size}"
    grid = slots.reshape(-1, page_size)  # (num_pages, page_size)
    firsts = grid[:, 0].astype(np.int64)  # (num_pages,)
    assert not (firsts % page_size).any(), "slots do not start on a page boundary"
    assert (grid - grid[:, :1] == np.arange(page_size)).all(), "slots are not whole pages"
    return firsts // page_size


class PageAllocator:
    """A stack of free page ids plus an is-free byte per page.

    alloc/free cost O(pages moved); the byte map catches double frees and foreign ids.
    Pages come back lowest id first on a fresh allocator (nothing depends on that order).
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.num_pages = num_pages
        self.page_size = page_size
        # The top of the stack is the end of the list, so pop order is 0, 1, 2, ...
        self._free_stack: list[int] = list(range(num_pages - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * num_pages

    @property
    def num_free_pages(self) -> int:
        return len(self._free_stack)

    @property
    def num_free_slots(self) -> int:
        return len(self._free_stack) * self.page_size

    def alloc(self, num_pages: int) -> list[int] | None:
        """Take `num_pages` pages, or None (taking nothing) when fewer are free."""
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        stack = self._free_stack
        if num_pages > len(stack):
            return None
        if num_pages == 0:
            return []
        start = len(stack) - num_pages
        pages = stack[start:]
        del stack[start:]
        pages.reverse()
        is_free = self._is_free
        for page in pages:
            is_free[page] = 0
        return pages

    def free(self, pages: Sequence[int]) -> None:
        """Give pages back. Freeing a free page or an id out of range is a caller bug."""
        is_free = self._is_free
        for page in pages:
            assert 0 <= page < self.num_pages, f"page {page} out of range [0, {self.num_pages})"
            assert not is_free[page], f"double free of page {page}"
            is_free[page] = 1
        self._free_stack.extend(pages)

    def pages_to_slots(self, pages: Sequence[int]) -> list[int]:
        """Every slot of every page, page by page, offsets in order."""
        ps = self.page_size
        if ps == 1:
            return list(pages)
        base = np.asarray(pages, dtype=np.int64)[:, None] * ps  # (num_pages, 1)
        slots: list[int] = (base + np.arange(ps, dtype=np.int64)).ravel().tolist()
        return slots  # (num_pages * ps,)

    def slots_to_pages(self, slots: Sequence[int]) -> list[int]:
        """Inverse of pages_to_slots: `slots` must be whole pages, each in offset order."""
        ps = self.page_size
        if ps == 1:
            return list(slots)
        pages: list[int] = whole_pages(np.asarray(slots, dtype=np.int64), ps).tolist()
        return pages

    def check_integrity(self) -> None:
        """Recompute the free set from both structures; AssertionError on any mismatch."""
        stack = self._free_stack
        assert len(set(stack)) == len(stack), "a page is on the free stack twice"
        assert all(0 <= p < self.num_pages for p in stack), "free stack holds a foreign id"
        assert all(self._is_free[p] for p in stack), "free stack and byte map disagree"
        assert sum(self._is_free) == len(stack), "byte map marks pages free that are not stacked"
