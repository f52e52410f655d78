"""The LoRA shrink/expand kernels (SGMV over segments, BGMV per token) against the torch
reference, on a batch that mixes adapters and the base model; on CUDA when present, else under
Triton's interpreter. fp32: within rtol = atol = 1e-5 (fp32 sums in another order); bf16
inputs: within one bf16 rounding step of y."""

from __future__ import annotations

import pytest
import torch

from triton_kernels.lora_expand import lora_expand, lora_expand_tokens
from triton_kernels.lora_shrink import lora_shrink, lora_shrink_tokens
from triton_kernels.reference import lora_ref
from triton_kernels.testing import device_or_error

DEVICE, DEVICE_ERROR = device_or_error()


@pytest.fixture(autouse=True)
def _runnable() -> None:
    if DEVICE_ERROR:
        pytest.fail(DEVICE_ERROR, pytrace=False)


def _case(seg_lens: list[int], slots: list[int], k: int, n: int, r: int, num_slots: int,
          dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    total = sum(seg_lens)
    x = torch.randn(total, k, generator=g).to(DEVICE, dtype)
    a = (torch.randn(num_slots, r, k, generator=g) * 0.2).to(DEVICE, dtype)
    b = (torch.randn(num_slots, n, r, generator=g) * 0.2).to(DEVICE, dtype)
    y = torch.randn(total, n, generator=g).to(DEVICE, dtype)
    token_slot = torch.tensor([s for s, m in zip(slots, seg_lens, strict=True)
                               for _ in range(m)], dtype=torch.int32, device=DEVICE)
    return x, a, b, y, token_slot


@pytest.mark.parametrize(("seg_lens", "slots", "k", "n", "r"), [
    ([5, 3, 0, 20], [0, -1, 2, 1], 64, 96, 8),  # base in the middle, an unused entry
    ([1, 1, 1, 1], [1, 0, -1, 1], 48, 40, 4),  # decode-like: one token each, odd sizes
    ([33], [2], 100, 130, 16),  # one adapter, tiles past every edge
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sgmv_and_bgmv_match_reference(seg_lens: list[int], slots: list[int], k: int, n: int,
                                       r: int, dtype: torch.dtype) -> None:
    x, a, b, y, token_slot = _case(seg_lens, slots, k, n, r, 3, dtype)
    want = lora_ref(x, a, b, y, token_slot)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2**-7,
                                                                         "atol": 2**-6}
    starts = [sum(seg_lens[:i]) for i in range(len(seg_lens))]
    seg = [torch.tensor(v, dtype=torch.int32, device=DEVICE) for v in (starts, seg_lens, slots)]
    t = torch.full((y.shape[0], r), float("nan"), device=DEVICE)  # base rows: never read
    got = lora_expand(lora_shrink(x, a, t, *seg, max(seg_lens)), b, y.clone(), *seg,
                      max(seg_lens))
    torch.testing.assert_close(got, want, **tol)
    base_rows = token_slot < 0
    assert torch.equal(got[base_rows], y[base_rows])  # the base model's rows untouched
    t2 = torch.zeros(y.shape[0], r, device=DEVICE)
    got2 = lora_expand_tokens(lora_shrink_tokens(x, a, t2, token_slot), b, y.clone(),
                              token_slot)
    torch.testing.assert_close(got2, want, **tol)


def test_segment_bound_larger_than_segments_is_harmless() -> None:
    """A graph captured for T tokens passes T as the bound whatever the segments are."""
    x, a, b, y, token_slot = _case([3, 4], [1, 0], 32, 32, 4, 2, torch.float32)
    seg = [torch.tensor(v, dtype=torch.int32, device=DEVICE) for v in ([0, 3, 0], [3, 4, 0],
                                                                       [1, 0, -1])]
    t = torch.zeros(7, 4, device=DEVICE)
    got = lora_expand(lora_shrink(x, a, t, *seg, 64), b, y.clone(), *seg, 64)
    torch.testing.assert_close(got, lora_ref(x, a, b, y, token_slot), rtol=1e-5, atol=1e-5)


def test_both_halves_check_their_operands_alike() -> None:
    """The shrink and the expand share one argument check (triton_kernels/_common.py): each
    refuses a rank buffer that is not float32, a stack of the wrong width and a token_slot
    of the wrong length, before any launch."""
    x, a, b, y, token_slot = _case([2, 2], [0, 1], 32, 24, 4, 2, torch.float32)
    seg = [torch.tensor(v, dtype=torch.int32, device=DEVICE) for v in ([0, 2], [2, 2], [0, 1])]
    t16 = torch.zeros(4, 4, dtype=torch.float16, device=DEVICE)
    with pytest.raises(AssertionError, match="must be float32"):
        lora_shrink(x, a, t16, *seg, 2)
    with pytest.raises(AssertionError, match="must be float32"):
        lora_expand(t16, b, y, *seg, 2)
    t = torch.zeros(4, 4, device=DEVICE)
    with pytest.raises(AssertionError, match="stack"):
        lora_shrink(x, b, t, *seg, 2)  # B (S, N, R) where A (S, R, K) belongs
    with pytest.raises(AssertionError, match="stack"):
        lora_expand(t, a, y, *seg, 2)
    with pytest.raises(AssertionError, match="token_slot"):
        lora_shrink_tokens(x, a, t, token_slot[:3])
    with pytest.raises(AssertionError, match="token_slot"):
        lora_expand_tokens(t, b, y, token_slot[:3])
