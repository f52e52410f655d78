"""The batch bitmask: built from the constrained rows' matchers, applied to the logits.

Owns: one int32 bitmask per step for the whole batch (unconstrained rows all ones), filling
the constrained rows (matchers are only read here), and the vectorized unpack + masked_fill
that sets every disallowed logit to -inf, in place, on the logits' device.
Does not know: requests' lifetimes (the scheduler creates and advances matchers).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from radixserve.grammar.backend import Matcher, bitmask_width


def build_mask(matchers: list[Matcher | None], vocab_size: int, device: torch.device,
               drafts: Sequence[Sequence[int]] | None = None) -> torch.Tensor | None:
    """(R, ceil(vocab / 32)) int32 on `device`; None when no row is constrained.

    Without drafts R == len(matchers), one row each. With drafts, entry i has
    1 + len(drafts[i]) consecutive rows: row j is the mask after drafts[i][:j], computed on
    a copy of its matcher (the request's own matcher is only read)."""
    if all(m is None for m in matchers):
        return None
    sizes = [1] * len(matchers) if drafts is None else [1 + len(d) for d in drafts]
    bits = torch.full((sum(sizes), bitmask_width(vocab_size)), -1, dtype=torch.int32)
    row = 0
    for i, (m, size) in enumerate(zip(matchers, sizes, strict=True)):
        if m is not None and size == 1:
            m.fill_row(bits, row)
        elif m is not None:
            _fill_draft_rows(m.copy(), bits, row, drafts[i] if drafts else ())
        row += size
    return bits.to(device, non_blocking=True)


def _fill_draft_rows(ahead: Matcher, bits: torch.Tensor, row: int,
                     draft: Sequence[int]) -> None:
    for j in range(len(draft) + 1):
        ahead.fill_row(bits, row + j)
        if j < len(draft) and not ahead.accept(draft[j]):
            return  # the draft leaves the grammar here: no later row can be accepted


def disallowed_tokens(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(B, W) int32 words -> (B, vocab) bool, True where the token is NOT allowed.

    Bit j of word w is token 32 * w + j. Viewed as little-endian bytes, byte i holds tokens
    8 * i .. 8 * i + 7, so one lookup in a (256, 8) table unpacks a byte (cheaper than
    shifting every word 32 times).
    """
    table = ((torch.arange(256, device=bits.device).unsqueeze(-1)
              >> torch.arange(8, device=bits.device)) & 1) == 0  # (256, 8): bit clear
    as_bytes = bits.contiguous().view(torch.uint8).long()  # (B, 4W)
    return table[as_bytes].view(bits.shape[0], -1)[:, :vocab_size]


def apply_mask(logits: torch.Tensor, bits: torch.Tensor) -> None:
    """In place on logits (B, vocab): disallowed tokens get -inf; all-ones rows are untouched."""
    logits.masked_fill_(disallowed_tokens(bits, logits.shape[-1]), float("-inf"))
