"""The batch bitmask: built from the constrained rows' matchers, applied to the logits.

Owns: one int32 bitmask per step for the whole batch (unconstrained rows all ones), filling
the constrained rows (matchers are only read here), and the vectorized unpack + masked_fill
that sets every disallowed logit to -inf, in place, on the logits' device.
Does not know: requests' lifetimes (the scheduler creates and advances matchers).
"""

from __future__ import annotations

import torch

from radixserve.grammar.backend import Matcher, bitmask_width


def build_mask(matchers: list[Matcher | None], vocab_size: int,
               device: torch.device) -> torch.Tensor | None:
    """(B, ceil(vocab / 32)) int32 on `device`; None when no row is constrained."""
    if all(m is None for m in matchers):
        return None
    bits = torch.full((len(matchers), bitmask_width(vocab_size)), -1, dtype=torch.int32)
    for i, m in enumerate(matchers):
        if m is not None:
            m.fill_row(bits, i)
    return bits.to(device, non_blocking=True)


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
