"""Rotary position embeddings: cos/sin tables for every position, for every scaling HF has.

Owns: inverse frequencies (default, linear, llama3, yarn, longrope), the cos/sin scale
(yarn's mscale / attention_factor, longrope's), the rotated width (partial rotary) and the
tables. Does not know: attention, the KV pool, how the rotation is applied
(layers/rotary.py: norm_rope.py's rope_qk, torch, or triton_kernels/rope.py).

LongRoPE: HF recomputes every position's frequencies with the long factors once a sequence
passes original_max_position (so earlier K would change); here a position below it uses the
short factors and one at or past it the long ones, so cached K stays valid (vLLM picks one
table per batch instead). Below original_max_position both equal HF exactly.
"""

from __future__ import annotations

import math

import torch

from radixserve.model.arch import RopeSpec


def rotary_dim(rope: RopeSpec, head_dim: int) -> int:
    """How many leading dimensions of each head RoPE rotates."""
    return int(head_dim * rope.partial_rotary_factor)


def _llama3(rope: RopeSpec, inv: torch.Tensor) -> torch.Tensor:
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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeSpec, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between."""
    base, factor = rope.theta, rope.factor

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(rope.original_max_position / (rotations * 2 * math.pi))) / (
            2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    att = rope.attention_factor
    if att is None:
        if rope.mscale and rope.mscale_all_dim:
            att = _yarn_mscale(factor, rope.mscale) / _yarn_mscale(factor, rope.mscale_all_dim)
        else:
            att = _yarn_mscale(factor)
    return inv, float(att)


def _longrope_scale(rope: RopeSpec) -> float:
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(rope.factor) / math.log(rope.original_max_position))


def inv_frequencies(rope: RopeSpec, head_dim: int, long: bool = False) -> torch.Tensor:
    """(rotary_dim / 2,) fp32 inverse frequencies (`long`: longrope's long factors)."""
    dim = rotary_dim(rope, head_dim)
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    if rope.kind == "yarn":
        return _yarn(rope, dim)[0]
    if rope.kind == "longrope":
        factors = rope.long_factor if long else rope.short_factor
        ext = torch.tensor(factors, dtype=torch.float32)
        return 1.0 / (ext * rope.theta**shape)
    inv = 1.0 / (rope.theta**shape)
    if rope.kind == "linear":
        return inv / rope.factor
    if rope.kind == "llama3":
        return _llama3(rope, inv)
    return inv


def cos_sin_scale(rope: RopeSpec, head_dim: int) -> float:
    """The factor HF multiplies cos and sin by (1.0 but for yarn and longrope)."""
    if rope.kind == "yarn":
        return _yarn(rope, rotary_dim(rope, head_dim))[1]
    if rope.kind == "longrope":
        return _longrope_scale(rope)
    return 1.0


class RotaryTable:
    """cos/sin for positions [0, max_positions), computed once in fp32; rotary_dim wide.

    `sin` is stored with its first half negated: rotate_half(x) * sin, HF's
    cat(-x2, x1) * sin, equals roll(x, half) * cat(-sin1, sin2) product for product (only
    signs move), so fp32 results are unchanged and one roll replaces two slices, a neg and
    a cat on every layer.
    """

    def __init__(self, rope: RopeSpec, head_dim: int, max_positions: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.rotary_dim = rotary_dim(rope, head_dim)
        self.head_dim = head_dim
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_frequencies(rope, head_dim))  # (max_positions, dim / 2)
        if rope.kind == "longrope" and max_positions > rope.original_max_position:
            start = rope.original_max_position
            freqs[start:] = torch.outer(pos[start:], inv_frequencies(rope, head_dim, long=True))
        emb = torch.cat([freqs, freqs], dim=-1)  # (max_positions, rotary_dim)
        half = self.rotary_dim // 2
        scale = cos_sin_scale(rope, head_dim)
        cos, sin = emb.cos(), emb.sin()
        if scale != 1.0:  # HF: cos() * attention_scaling, in fp32
            cos, sin = cos * scale, sin * scale
        sin[:, :half] = -sin[:, :half]
        self.cos = cos.to(device=device, dtype=dtype)  # (max_positions, rotary_dim)
        self.sin = sin.to(device=device, dtype=dtype)  # (max_positions, rotary_dim), signed

    @property
    def partial(self) -> bool:
        return self.rotary_dim != self.head_dim

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for the positions: (T, rotary_dim) each."""
        return self.cos.index_select(0, positions), self.sin.index_select(0, positions)
