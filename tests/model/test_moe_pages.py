"""The MoE op's stacked expert weights in 2 MB pages (layers/moe_pages.py): the copy is equal,
starts on a 2 MB boundary and its mapping is advised MADV_HUGEPAGE (the kernel's `hg` flag);
the block puts its float and int8 stacked weights there and gives the same output; small
tensors, RADIXSERVE_MOE_HUGE_PAGES=0 and hosts without THP keep the tensor as it is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from radixserve.model.layers import moe_pages
from radixserve.model.layers.moe import MoEBlock, MoEWeights
from radixserve.model.layers.moe_pages import (
    ENV_HUGE_PAGES,
    HUGE_PAGE,
    in_huge_pages,
    thp_available,
    to_huge_pages,
)
from radixserve.model.layers.moe_spec import MoESpec

needs_thp = pytest.mark.skipif(not thp_available(), reason="no transparent huge pages here")

# 8 experts, hidden 256, width 512: gate_up 2 MiB in fp32, past one huge page
EXPERTS, HIDDEN, INTER = 8, 256, 512


def vm_flags(address: int) -> list[str]:
    """The VmFlags of this process's mapping that holds `address` (/proc/self/smaps)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(a, 16) for a in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {address:#x}")


def weights(seed: int) -> MoEWeights:
    g = torch.Generator().manual_seed(seed)
    return MoEWeights(router=torch.randn(EXPERTS, HIDDEN, generator=g),
                      gate_up=torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g) * 0.05,
                      down=torch.randn(EXPERTS, HIDDEN, INTER, generator=g) * 0.05)


@needs_thp
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_copy_is_equal_aligned_and_advised(dtype: torch.dtype) -> None:
    t = (torch.randn(3, 700, 1000) * 50).to(dtype)  # not a whole number of huge pages
    out = in_huge_pages(t)
    assert out.dtype == dtype and out.shape == t.shape and out.is_contiguous()
    assert torch.equal(out, t) and out.data_ptr() != t.data_ptr()
    assert out.data_ptr() % HUGE_PAGE == 0
    assert "hg" in vm_flags(out.data_ptr())
    assert "hg" in vm_flags(out.data_ptr() + out.nbytes - 1)
    out.add_(1) if dtype != torch.int8 else out.fill_(3)  # writable, and t is untouched
    assert not torch.equal(out, t)


@needs_thp
@pytest.mark.parametrize("int8", [False, True])
def test_block_keeps_its_stacked_weights_in_huge_pages(int8: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    spec = MoESpec(num_experts=EXPERTS, top_k=2, expert_size=INTER, renormalize=True)
    w = weights(1)
    block = MoEBlock(spec, w, int8=int8)
    assert block.native is not None, "the op must build where the tests run"
    assert block.gate_up is not None and block.down is not None
    # gate_up: 8 MiB fp32 / 2 MiB int8 codes; down: 4 MiB fp32 / 1 MiB int8 (stays as it is)
    assert block.gate_up.data_ptr() % HUGE_PAGE == 0 and "hg" in vm_flags(block.gate_up.data_ptr())
    assert (block.down.data_ptr() % HUGE_PAGE == 0) != int8
    monkeypatch.setenv(ENV_HUGE_PAGES, "0")
    plain = MoEBlock(spec, w, int8=int8)
    assert plain.gate_up is not None and plain.gate_up.data_ptr() % HUGE_PAGE != 0
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(2))
    assert torch.equal(block(x, x), plain(x, x))


def test_small_strided_switched_off_or_no_thp_keep_the_tensor(
        monkeypatch: pytest.MonkeyPatch) -> None:
    small = torch.randn(100, 100)
    assert to_huge_pages(small) is small
    big = torch.randn(HUGE_PAGE // 2)  # 4 MiB fp32
    strided = big[::2]
    assert to_huge_pages(strided) is strided
    monkeypatch.setenv(ENV_HUGE_PAGES, "0")
    assert to_huge_pages(big) is big
    monkeypatch.delenv(ENV_HUGE_PAGES)
    monkeypatch.setattr(moe_pages, "thp_available", lambda: False)
    assert to_huge_pages(big) is big
