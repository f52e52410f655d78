"""LoRA deltas of one forward: each adapter's low-rank update added to its tokens' outputs.

Owns: `LoRAWeights` (one fused target's A and B), `LoRABatch` (which contiguous token segments
of a step use which adapter), `StepLoRA` (the LoraHook every LinearLayer of a LoRA-enabled
model carries: it applies the batch set around the current forward) and `add_delta`, the only
place the deltas are added:
y[seg] += (x[seg] @ A.T) @ B.T for every adapter segment, i.e. one shrink and one expand GEMM
per segment and target (fused q/k/v and gate/up are one target each: peft_format.py stacks
their A's and block-diagonalizes their B's). Segments, never tokens: the Python loop runs once
per adapter run in the batch, and the scheduler keeps one adapter's requests contiguous.
On CUDA the same math runs as Triton kernels (triton_kernels/lora_shrink.py, lora_expand.py)
over the segments. Does not know: files, requests, the scheduler, radix keys.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixserve.model.layers.linear import LinearLayer
    from radixserve.model.lora_slots import LoRASlots


@dataclass(frozen=True)
class LoRAWeights:
    """One fused target of one layer: delta(x) = (x @ a.T) @ b.T."""

    a: torch.Tensor  # (R, in)
    b: torch.Tensor  # (out, R), the adapter's scaling folded in


AdapterLayers = Sequence[Mapping[str, LoRAWeights]]  # per layer: target -> weights


@dataclass(frozen=True)
class LoRASegment:
    start: int  # first token row
    end: int  # one past the last
    layers: AdapterLayers  # the adapter's weights


@dataclass(frozen=True)
class KernelSegments:
    """The segments as the Triton kernels read them (CUDA, or CPU under the interpreter)."""

    slots: LoRASlots  # the device stacks the segments' slots index
    seg_start: torch.Tensor  # (G,) int32
    seg_len: torch.Tensor  # (G,) int32
    seg_slot: torch.Tensor  # (G,) int32, -1: the base model
    token_slot: torch.Tensor | None  # (T,) int32: one token per request (decode: BGMV)
    max_seg_len: int


@dataclass(frozen=True)
class LoRABatch:
    """The adapter segments of one forward's token rows (base-model rows are in none)."""

    segments: tuple[LoRASegment, ...]
    kernels: KernelSegments | None = None  # set: the deltas run as Triton kernels

    def on_slots(self, slots: LoRASlots, num_tokens: int, decode: bool) -> LoRABatch:
        """This batch for the kernels: its adapters placed in `slots`, segments as tensors."""
        slot_of = dict(zip((id(s.layers) for s in self.segments),
                           slots.slots_for(list({id(s.layers): s.layers
                                                 for s in self.segments}.values())), strict=True))
        dev = slots.device
        starts = [s.start for s in self.segments]
        lens = [s.end - s.start for s in self.segments]
        seg_slots = [slot_of[id(s.layers)] for s in self.segments]
        token_slot = None
        if decode:
            per_token = [-1] * num_tokens
            for s, slot in zip(self.segments, seg_slots, strict=True):
                per_token[s.start : s.end] = [slot] * (s.end - s.start)
            token_slot = torch.tensor(per_token, dtype=torch.int32, device=dev)
        def i32(v: list[int]) -> torch.Tensor:
            return torch.tensor(v, dtype=torch.int32, device=dev)

        k = KernelSegments(slots, i32(starts), i32(lens), i32(seg_slots), token_slot, max(lens))
        return LoRABatch(self.segments, k)

    @staticmethod
    def from_runs(runs: Sequence[tuple[AdapterLayers | None, int]]) -> LoRABatch | None:
        """`runs`: (adapter or None for the base, token count) in row order; consecutive runs
        of one adapter merge. None when no row uses an adapter."""
        segments: list[LoRASegment] = []
        row = 0
        for layers, n in runs:
            if layers is not None and n > 0:
                last = segments[-1] if segments else None
                if last is not None and last.layers is layers and last.end == row:
                    segments[-1] = LoRASegment(last.start, row + n, layers)
                else:
                    segments.append(LoRASegment(row, row + n, layers))
            row += n
        return LoRABatch(tuple(segments)) if segments else None

    def add_delta(self, layer: int, target: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y += each segment's delta of `target` in `layer`, in place.
        x: (T, in) the target's input; y: (T, out) its output (plus anything already added)."""
        if self.kernels is not None:
            self._add_delta_kernels(self.kernels, layer, target, x, y)
            return
        for seg in self.segments:
            w = seg.layers[layer].get(target)
            if w is None:
                continue  # this adapter does not train this target
            xs = x[seg.start : seg.end]  # (n, in)
            shrunk = torch.mm(xs, w.a.t())  # (n, R)
            y[seg.start : seg.end].addmm_(shrunk, w.b.t())  # (n, out) += (n, R) @ (R, out)

    @staticmethod
    def _add_delta_kernels(k: KernelSegments, layer: int, target: str, x: torch.Tensor,
                           y: torch.Tensor) -> None:
        # Imported here: triton is needed only where the kernels run.
        from triton_kernels.lora_expand import lora_expand, lora_expand_tokens
        from triton_kernels.lora_shrink import lora_shrink, lora_shrink_tokens

        a, b = k.slots.a[layer][target], k.slots.b[layer][target]  # (S, R, in), (S, out, R)
        t = torch.empty(x.shape[0], a.shape[1], dtype=torch.float32, device=x.device)  # (T, R)
        if k.token_slot is not None:
            lora_expand_tokens(lora_shrink_tokens(x, a, t, k.token_slot), b, y, k.token_slot)
            return
        seg = (k.seg_start, k.seg_len, k.seg_slot)
        lora_expand(lora_shrink(x, a, t, *seg, k.max_seg_len), b, y, *seg, k.max_seg_len)


class StepLoRA:
    """The LoraHook (model/layers/linear.py) of a model built with adapters: each LinearLayer
    named `qkv_proj`, `o_proj`, `gate_up_proj` or `down_proj` gets its adapters' deltas for
    the forward running inside `using(batch)` (none outside it: base-only steps, CUDA graph
    capture). The runner's attribute, set once per forward, never nested."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None

    @contextmanager
    def using(self, batch: LoRABatch | None) -> Iterator[None]:
        assert self.batch is None, "one forward at a time"
        self.batch = batch
        try:
            yield
        finally:
            self.batch = None

    def __call__(self, layer: LinearLayer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.batch is not None:
            self.batch.add_delta(layer.layer, layer.name, x, y)
        return y
