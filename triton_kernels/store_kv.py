"""Scatter this forward's new K/V rows into the paged KV pool.

Owns: the store kernel and its wrapper. Does not know: pages, requests or the radix tree;
a slot is just a row index of the (num_slots, kv_heads, head_dim) caches.
"""

# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (triton is untyped, and @triton.jit kernel parameters carry no Python types.)

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton_kernels._common import (
    check_heads_last_contiguous,
    check_index,
    check_kv_cache,
    check_launchable,
)


@triton.jit
def _store_kv_kernel(
    k_cache, v_cache, k, v, slots,
    stride_kt, stride_kh, stride_vt, stride_vh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    # One program per token: its (heads, head_dim) tile moves as one block.
    t = tl.program_id(0)
    slot = tl.load(slots + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_HEADS) & (offs_d[None, :] < HEAD_DIM)
    t64 = t.to(tl.int64)
    k_tile = tl.load(k + t64 * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v_tile = tl.load(v + t64 * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    # The caches are contiguous: slot-major, then head, then head_dim.
    dst = slot * (NUM_HEADS * HEAD_DIM) + offs_h[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(k_cache + dst, k_tile, mask=mask)
    tl.store(v_cache + dst, v_tile, mask=mask)


def store_kv(
    k_cache: torch.Tensor,  # (num_slots, kv_heads, head_dim), written in place
    v_cache: torch.Tensor,  # (num_slots, kv_heads, head_dim), written in place
    k: torch.Tensor,  # (T, kv_heads, head_dim)
    v: torch.Tensor,  # (T, kv_heads, head_dim)
    slots: torch.Tensor,  # (T,) int32/int64, distinct, each in [0, num_slots)
) -> None:
    """k_cache[slots] = k; v_cache[slots] = v.

    Slots are not range-checked on the device (that would need a sync): the caller owns them.
    """
    check_kv_cache(k_cache, v_cache)
    _, num_heads, head_dim = k_cache.shape
    num_tokens = k.shape[0]
    check_heads_last_contiguous("k", k, num_heads, head_dim)
    check_heads_last_contiguous("v", v, num_heads, head_dim)
    assert v.shape[0] == num_tokens, f"k has {num_tokens} tokens, v has {v.shape[0]}"
    assert k.dtype == k_cache.dtype and v.dtype == k_cache.dtype, (
        f"k/v dtypes {k.dtype}/{v.dtype} differ from the cache's {k_cache.dtype}"
    )
    assert k.device == k_cache.device and v.device == k_cache.device
    check_index("slots", slots, num_tokens, k_cache.device)
    if num_tokens == 0:
        return
    check_launchable(_store_kv_kernel, k_cache.device)
    _store_kv_kernel[(num_tokens,)](
        k_cache, v_cache, k, v, slots,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim,
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim),
    )
