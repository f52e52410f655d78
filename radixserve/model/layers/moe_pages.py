"""The CPU MoE op's stacked expert weights in 2 MB pages (transparent huge pages).

Owns: `in_huge_pages` (a CPU tensor's copy in a 2 MB-aligned private anonymous mapping
advised MADV_HUGEPAGE before its first touch, so the kernel backs it with 2 MB pages), the
rule for which tensors get one (`huge_pages_apply`), and its switch ($RADIXSERVE_MOE_HUGE_PAGES,
"0": off). Does not know: which tensors are expert weights (layers/moe.py asks for the
stacked (E, ...) tensors the native op streams), the dense linears' weights.

Why: a decode step at batch 16 streams ~90 MB of active experts per layer, and on 4 KB pages
the hardware prefetcher stops at every page boundary and every page costs a TLB walk; in 2 MB
pages the same read runs faster (bench/README.md, "Mixture of experts on CPU"). Only memory
advised MADV_HUGEPAGE gets them where the host's THP mode is `madvise` (the usual default),
and torch's allocator advises nothing (unless THP_MEM_ALLOC_ENABLE=1 for the whole process).

The copy replaces the tensor the caller keeps: the original is freed when its last reference
goes (the loader's, after the model is built), so loading briefly holds both.
"""

from __future__ import annotations

import mmap
import os

import torch

from radixserve.platform.huge_pages import HUGE_PAGE, thp_mode

ENV_HUGE_PAGES = "RADIXSERVE_MOE_HUGE_PAGES"  # "0": leave the expert weights on 4 KB pages


def thp_available() -> bool:
    """Whether madvise(MADV_HUGEPAGE) can get 2 MB pages here: Linux with THP not `never`."""
    return hasattr(mmap, "MADV_HUGEPAGE") and thp_mode() in ("always", "madvise")


def huge_pages_apply(t: torch.Tensor) -> bool:
    """Whether `t` goes to 2 MB pages: switched on, a contiguous CPU tensor of at least one
    huge page (a smaller one would sit in a single page's worth of 4 KB pages anyway), THP
    available."""
    if os.environ.get(ENV_HUGE_PAGES, "").strip() == "0":
        return False
    return (t.device.type == "cpu" and t.is_contiguous() and t.nbytes >= HUGE_PAGE
            and thp_available())


def in_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """A copy of the contiguous CPU tensor `t` starting on a 2 MB boundary of its own private
    anonymous mapping, advised MADV_HUGEPAGE before the copy touches it (a fault then
    allocates a whole 2 MB page). The mapping lives as long as the returned tensor."""
    assert t.device.type == "cpu" and t.is_contiguous()
    size = -(-t.nbytes // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # room to align the start
    # MAP_PRIVATE: a shared anonymous mapping is shmem, whose THP setting is separate (and
    # usually never)
    mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(mm, dtype=torch.uint8)  # (size,): keeps `mm` alive
    start = -raw.data_ptr() % HUGE_PAGE  # a multiple of 4 KB: mmap returns page-aligned
    mm.madvise(mmap.MADV_HUGEPAGE, start, size - start)
    out = raw[start:start + t.nbytes].view(t.dtype).view(t.shape)
    out.copy_(t)
    return out


def to_huge_pages(t: torch.Tensor) -> torch.Tensor:
    """`t` in 2 MB pages where `huge_pages_apply` says so (in_huge_pages), else `t` itself."""
    return in_huge_pages(t) if huge_pages_apply(t) else t
