"""Graph inputs: the batch-size buckets and the static, padded input buffers of a CUDA graph.

Owns: which bucket a batch size takes, the layout a step is padded into, and copying a step's
inputs into that layout. Does not know: graphs themselves (cuda_graph.py captures and replays
them), requests, the model. Pure tensor code: runs and is tested on CPU.

A bucket of `bs` requests has `stride` token rows per request: 1 for decode, K + 1 for a
verify step (K = num_speculative_tokens):
    requests 0 .. B-1    rows [b * stride, b * stride + n_b): the step's tokens of request b;
                         rows past n_b (a draft shorter than K) are padding tokens
    requests B .. bs-1   padding requests: table row pad_row, prefix 0, one token
A padding token has id 0, position 0 and stores its K/V at the pool's pad_slot; a padding
request attends to pad_slot only. So padding writes nothing a request reads, and the
row-wise math (norms, projections, MLP) keeps real rows exactly what they are eagerly.
Every step rewrites the whole bucket, tail included: a stale row left by a larger earlier
step would otherwise store its K/V into a slot that now belongs to someone else.
"""

from __future__ import annotations

import bisect
import enum
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import torch

from radixserve.attention.base import AttentionMetadata
from radixserve.types import Phase

if TYPE_CHECKING:
    from radixserve.engine.step_inputs import StepInputs

SMALL_SIZES = (1, 2, 4, 8)
SIZE_STEP = 8  # past 8, a bucket every 8 requests


class GraphKind(enum.Enum):
    DECODE = "decode"  # one token per request
    VERIFY = "verify"  # each request's last token and up to K draft tokens


class GraphKey(NamedTuple):
    kind: GraphKind
    bs: int  # the bucket: requests the graph computes, padding included


def graph_batch_sizes(max_bs: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 8 below max_bs, then max_bs: every size up to max_bs fits one."""
    if max_bs < 1:
        raise ValueError(f"max_bs must be >= 1, got {max_bs}")
    sizes = {s for s in SMALL_SIZES if s < max_bs}
    sizes.update(range(2 * SIZE_STEP, max_bs, SIZE_STEP))
    sizes.add(max_bs)
    return tuple(sorted(sizes))


def bucket_for(batch_size: int, sizes: Sequence[int]) -> int | None:
    """The smallest size in `sizes` (ascending) holding batch_size; None past the largest."""
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


def describe_sizes(sizes: Sequence[int]) -> str:
    """'1, 2, 4, 8, 16..256 every 8': what a start-up log line can hold."""
    small = [str(s) for s in sizes if s <= SIZE_STEP]
    grid = [s for s in sizes if s > SIZE_STEP and s % SIZE_STEP == 0]
    odd = [str(s) for s in sizes if s > SIZE_STEP and s % SIZE_STEP]
    mid = ([f"{grid[0]}..{grid[-1]} every {SIZE_STEP}"] if len(grid) > 2
           else [str(s) for s in grid])
    return ", ".join(small + mid + odd)


def strided_rows(extend_lens: torch.Tensor, cu_extend: torch.Tensor, num_tokens: int,
                 stride: int) -> torch.Tensor:
    """(T,) int64: the bucket row of each packed token; token j of request b -> b * stride + j.

    extend_lens (B,), cu_extend (B + 1,) as in AttentionMetadata; no host-device sync.
    """
    dev = extend_lens.device
    batch = extend_lens.shape[0]
    req = torch.repeat_interleave(torch.arange(batch, device=dev), extend_lens,
                                  output_size=num_tokens)  # (T,) request of each token
    offset = torch.arange(num_tokens, device=dev) - cu_extend[req].long()  # (T,) j
    return req * stride + offset


def _put(buf: torch.Tensor, bs: int, src: torch.Tensor, pad: int) -> None:
    """buf[:len(src)] = src, buf[len(src):bs] = pad."""
    n = src.shape[0]
    buf[:n].copy_(src)
    buf[n:bs].fill_(pad)


class StaticInputs:
    """One kind's input buffers, sized for its largest bucket. A bucket's graph reads views of
    their first rows, so all buckets of a kind share them. Starts as all padding."""

    def __init__(self, max_bs: int, stride: int, pad_row: int, pad_slot: int,
                 slot_table: torch.Tensor) -> None:
        self.stride, self.pad_row, self.pad_slot = stride, pad_row, pad_slot
        self.slot_table = slot_table  # (max_reqs + 1, max_model_len) int32, the pool's
        dev, n = slot_table.device, max_bs * stride
        i64, i32 = torch.int64, torch.int32
        self.input_ids = torch.zeros(n, dtype=i64, device=dev)  # (bs * stride,)
        self.positions = torch.zeros(n, dtype=i64, device=dev)  # (bs * stride,)
        self.out_slots = torch.full((n,), pad_slot, dtype=i64, device=dev)  # (bs * stride,)
        self.rows = torch.full((max_bs,), pad_row, dtype=i64, device=dev)  # (bs,)
        self.prefix_lens = torch.zeros(max_bs, dtype=i32, device=dev)  # (bs,)
        self.extend_lens = torch.ones(max_bs, dtype=i32, device=dev)  # (bs,)
        self.seq_lens = torch.ones(max_bs, dtype=i32, device=dev)  # (bs,)
        # Fixed: request b's tokens start at b * stride whatever its length.
        self.cu_extend = torch.arange(0, (max_bs + 1) * stride, stride, dtype=i32,
                                      device=dev)  # (bs + 1,)
        self.logit_rows = torch.arange(n, dtype=i64, device=dev)  # every row: a fixed LM head

    def fill(self, inputs: StepInputs, bs: int) -> torch.Tensor:
        """Copy a step of B <= bs requests into the first bs requests' rows and pad the rest.
        Returns (N,) the bucket rows holding inputs.logit_rows' tokens, in their order."""
        meta = inputs.meta
        _put(self.rows, bs, meta.rows, self.pad_row)
        _put(self.prefix_lens, bs, meta.prefix_lens, 0)
        _put(self.extend_lens, bs, meta.extend_lens, 1)
        _put(self.seq_lens, bs, meta.seq_lens, 1)
        tokens = ((self.input_ids, inputs.input_ids, 0), (self.positions, inputs.positions, 0),
                  (self.out_slots, meta.out_slots, self.pad_slot))
        if self.stride == 1:  # decode: token b is request b's, already in place
            for buf, src, pad in tokens:
                _put(buf, bs, src, pad)
            return inputs.logit_rows
        dest = strided_rows(meta.extend_lens, meta.cu_extend, inputs.input_ids.shape[0],
                            self.stride)  # (T,)
        n = bs * self.stride
        for buf, src, pad in tokens:
            buf[:n].fill_(pad)
            buf.index_copy_(0, dest, src)
        return dest.index_select(0, inputs.logit_rows)

    def meta(self, bs: int, host: AttentionMetadata | None = None) -> AttentionMetadata:
        """Metadata over the first bs requests' views. Its host-side copies are the step's
        (`host`, padded) for an eager run; a graph is captured with all-padding ones, which
        the graph-safe backend never reads (beyond max_extend_len = stride, fixed)."""
        pad = bs - (host.batch_size if host is not None else 0)
        prefix = (host.prefix_lens_cpu if host else ()) + (0,) * pad
        extend = (host.extend_lens_cpu if host else ()) + (1,) * pad
        rows_cpu = (host.rows_cpu if host else ()) + (self.pad_row,) * pad
        n = bs * self.stride
        return AttentionMetadata(
            phase=Phase.DECODE if self.stride == 1 else Phase.PREFILL,
            slot_table=self.slot_table, rows=self.rows[:bs], prefix_lens=self.prefix_lens[:bs],
            extend_lens=self.extend_lens[:bs], seq_lens=self.seq_lens[:bs],
            cu_extend=self.cu_extend[: bs + 1], out_slots=self.out_slots[:n],
            prefix_lens_cpu=prefix, extend_lens_cpu=extend,
            max_seq_len=max(p + e for p, e in zip(prefix, extend, strict=True)),
            max_extend_len=self.stride, rows_cpu=rows_cpu,
        )
