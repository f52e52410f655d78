"""LoRA deltas of one forward: each adapter's low-rank update added to its tokens' outputs.

Owns: `LoRAWeights` (one fused target's A and B), `LoRABatch` (which contiguous token segments
of a step use which adapter) and `add_delta`, the only place the forward adds them:
y[seg] += (x[seg] @ A.T) @ B.T for every adapter segment, i.e. one shrink and one expand GEMM
per segment and target (fused q/k/v and gate/up are one target each: peft_format.py stacks
their A's and block-diagonalizes their B's). Segments, never tokens: the Python loop runs once
per adapter run in the batch, and the scheduler keeps one adapter's requests contiguous.
On CUDA the same math runs as Triton kernels (triton_kernels/lora_shrink.py, lora_expand.py)
over the segments. Does not know: files, requests, the scheduler, radix keys.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


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
class LoRABatch:
    """The adapter segments of one forward's token rows (base-model rows are in none)."""

    segments: tuple[LoRASegment, ...]

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
        for seg in self.segments:
            w = seg.layers[layer].get(target)
            if w is None:
                continue  # this adapter does not train this target
            xs = x[seg.start : seg.end]  # (n, in)
            shrunk = torch.mm(xs, w.a.t())  # (n, R)
            y[seg.start : seg.end].addmm_(shrunk, w.b.t())  # (n, out) += (n, R) @ (R, out)
