"""Rotary position embeddings: cos/sin tables for every position, with Llama-3 scaling.

Owns: inverse frequencies (default, linear, llama3) and the cos/sin tables. Does not know:
attention, the KV pool, how the rotation is applied (norm_rope.py's rope_qk,
or triton_kernels/rope.py on the fused path).
"""

from __future__ import annotations

import math

import torch

from radixserve.model.arch import RopeSpec


def inv_frequencies(rope: RopeSpec, head_dim: int) -> torch.Tensor:
    inv = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "linear":
        return inv / rope.factor
    if rope.kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended.
        low_wavelen = rope.original_max_position / rope.low_freq_factor
        high_wavelen = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(mid, blended, scaled)
    return inv


class RotaryTable:
    """cos/sin for positions [0, max_positions), computed once in fp32.

    `sin` is stored with its first half negated: rotate_half(x) * sin, HF's
    cat(-x2, x1) * sin, equals roll(x, half) * cat(-sin1, sin2) product for product (only
    signs move), so fp32 results are unchanged and one roll replaces two slices, a neg and
    a cat on every layer.
    """

    def __init__(self, rope: RopeSpec, head_dim: int, max_positions: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        inv = inv_frequencies(rope, head_dim)  # (head_dim / 2,)
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv)  # (max_positions, head_dim / 2)
        emb = torch.cat([freqs, freqs], dim=-1)  # (max_positions, head_dim)
        half = head_dim // 2
        sin = emb.sin()
        sin[:, :half] = -sin[:, :half]
        self.cos = emb.cos().to(device=device, dtype=dtype)  # (max_positions, head_dim)
        self.sin = sin.to(device=device, dtype=dtype)  # (max_positions, head_dim), signed

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for the positions: (T, head_dim) each."""
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)
