"""The batch bitmask: built from the constrained rows' matchers, applied to the logits.

Owns: allocating one int32 bitmask per step for the whole batch, filling the constrained
rows (matchers are only read here), and the vectorized masked_fill that sets every
disallowed logit of those rows to -inf. Unconstrained rows are untouched.
Does not know: requests' lifetimes (the scheduler creates and advances matchers).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.grammar.backend import Matcher, bitmask_width


@dataclass(frozen=True)
class BatchMask:
    rows: torch.Tensor  # (R,) int64 on the logits' device: the constrained rows
    bits: torch.Tensor  # (R, ceil(vocab / 32)) int32 on the logits' device


def build_mask(matchers: list[Matcher | None], vocab_size: int,
               device: torch.device) -> BatchMask | None:
    """One bitmask for the batch's constrained rows; None when no row is constrained."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return None
    bits = torch.empty(len(rows), bitmask_width(vocab_size), dtype=torch.int32)
    for j, i in enumerate(rows):
        m = matchers[i]
        assert m is not None
        m.fill_row(bits, j)
    return BatchMask(torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True),
                     bits.to(device, non_blocking=True))


def allowed_tokens(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(R, W) int32 words -> (R, vocab) bool: bit j of word w is token 32 * w + j."""
    shifts = torch.arange(32, dtype=torch.int32, device=bits.device)
    expanded = (bits.unsqueeze(-1) >> shifts) & 1  # (R, W, 32)
    return expanded.view(bits.shape[0], -1)[:, :vocab_size].bool()


def apply_mask(logits: torch.Tensor, mask: BatchMask) -> None:
    """In place on logits (B, vocab): disallowed tokens of the constrained rows get -inf."""
    allowed = allowed_tokens(mask.bits, logits.shape[-1])
    logits[mask.rows] = logits[mask.rows].masked_fill(~allowed, float("-inf"))
