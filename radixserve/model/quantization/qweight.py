"""QWeight: every quantized format's linear weight in one canonical form, and its algebra.

Owns: the canonical form (codes, group scales and zero points, an optional input
permutation), `dequantize` (the specification every kernel is tested against), row and
column slices for tensor parallelism, stacking projections along the output dim (q/k/v,
gate/up), and the load-time round-to-nearest quantizers (`--quantization fp8`, and the test
helpers' W4/W8). Does not know: checkpoint tensor names (formats.py), kernels, devices.

  W[n, k] = (code[n, k] - zero[n, g]) * scale[n, g]    (INT4, INT8; g = k // group_size)
  W[n, k] = e4m3(code[n, k]) * scale[n, g]               (FP8: codes are the fp8 bit patterns)
and with `perm`: column k of W multiplies input perm[k] (GPTQ act-order, grouped by g_idx).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import torch

from radixserve.model_source import ModelLoadError

FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


class Kind(enum.IntEnum):
    """The code width; the values are the native kernel's `kind` argument."""
    INT4 = 0
    INT8 = 1
    FP8 = 2


@dataclass(frozen=True)
class QWeight:
    kind: Kind
    codes: torch.Tensor  # (N, K) uint8: unsigned int codes, or fp8 e4m3 bit patterns
    scale: torch.Tensor  # (N, G) float32, G = ceil(K / group_size)
    zero: torch.Tensor | None  # (N, G) float32 for INT4 / INT8; None for FP8
    group_size: int  # inputs per group (K: one group per output channel)
    perm: torch.Tensor | None = None  # (K,) int64: column k multiplies input perm[k]

    @property
    def shape(self) -> tuple[int, int]:
        n, k = self.codes.shape
        return n, k

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        groups = -(-k // self.group_size)
        assert self.codes.dtype == torch.uint8, self.codes.dtype
        assert tuple(self.scale.shape) == (n, groups), (self.scale.shape, n, groups)
        assert (self.zero is None) == (self.kind is Kind.FP8)
        assert self.zero is None or self.zero.shape == self.scale.shape

    def values(self) -> torch.Tensor:
        """(N, K) float32: the codes as numbers (minus nothing: zero points not applied)."""
        if self.kind is Kind.FP8:
            return self.codes.view(torch.float8_e4m3fn).float()
        return self.codes.float()

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32 in the inputs' own order: the weight this one stands for."""
        n, k = self.shape
        idx = torch.arange(k, device=self.codes.device) // self.group_size  # (K,)
        v = self.values()
        if self.zero is not None:
            v = v - self.zero[:, idx]
        w = v * self.scale[:, idx]  # (N, K)
        if self.perm is None:
            return w
        out = torch.empty_like(w)
        out[:, self.perm] = w
        return out

    def rows(self, rows: slice | None) -> QWeight:
        """Output channels `rows` (a column-parallel shard)."""
        if rows is None:
            return self
        return replace(self, codes=self.codes[rows], scale=self.scale[rows],
                       zero=None if self.zero is None else self.zero[rows])

    def cols(self, cols: slice | None) -> QWeight:
        """Inputs `cols` (a row-parallel shard); they must start and end on group borders."""
        if cols is None:
            return self
        k = self.shape[1]
        start, stop, _ = cols.indices(k)
        g = self.group_size
        if self.perm is not None:
            raise ModelLoadError("GPTQ desc_act (act-order) weights cannot be split by input "
                                 "columns across tensor-parallel ranks")
        if g < k and (start % g or (stop % g and stop != k)):
            raise ModelLoadError(f"a tensor-parallel shard of inputs [{start}, {stop}) does "
                                 f"not fall on the quantization groups of {g} inputs")
        gs = slice(start // g, -(-stop // g)) if g < k else slice(None)
        return replace(self, codes=self.codes[:, start:stop], scale=self.scale[:, gs],
                       zero=None if self.zero is None else self.zero[:, gs],
                       group_size=g if g < k else stop - start)


def can_stack(parts: list[QWeight]) -> bool:
    """Whether these projections of one input can be one weight (same kind, groups, order)."""
    first = parts[0]
    return all(p.kind is first.kind and p.group_size == first.group_size and
               p.shape[1] == first.shape[1] and _same_perm(p.perm, first.perm)
               for p in parts)


def _same_perm(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return bool(torch.equal(a, b))


def stack_rows(parts: list[QWeight]) -> QWeight:
    """The projections' weights one above the other (e.g. q, k, v -> qkv); see can_stack."""
    assert can_stack(parts)
    zero = None if parts[0].zero is None else torch.cat([p.zero for p in parts  # type: ignore[misc]
                                                         ])
    return replace(parts[0], codes=torch.cat([p.codes for p in parts]),
                   scale=torch.cat([p.scale for p in parts]), zero=zero)


def to_fp8_codes(w: torch.Tensor) -> torch.Tensor:
    """float values already in fp8's range -> their e4m3 bit patterns (N, K) uint8."""
    return w.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).view(torch.uint8)


def quantize_fp8(weight: torch.Tensor, group_size: int | None = None) -> QWeight:
    """Round-to-nearest FP8 with one scale per output channel (per `group_size` inputs when
    given): what `--quantization fp8` does to a float checkpoint's linear weights."""
    w = weight.detach().float()  # (N, K)
    n, k = w.shape
    g = k if group_size is None else group_size
    groups = -(-k // g)
    padded = torch.nn.functional.pad(w, (0, groups * g - k)).view(n, groups, g)
    scale = (padded.abs().amax(dim=2) / FP8_MAX).clamp_min(1e-12)  # (N, G)
    idx = torch.arange(k) // g
    return QWeight(Kind.FP8, to_fp8_codes(w / scale[:, idx]), scale, None, g)


def quantize_int(weight: torch.Tensor, bits: int, group_size: int, symmetric: bool = True
                 ) -> QWeight:
    """Round-to-nearest int4 / int8 per group of inputs (symmetric: zero point 2^(bits-1))."""
    w = weight.detach().float()  # (N, K)
    n, k = w.shape
    groups = -(-k // group_size)
    padded = torch.nn.functional.pad(w, (0, groups * group_size - k)).view(n, groups, -1)
    top = (1 << bits) - 1
    if symmetric:
        mid = float(1 << (bits - 1))
        scale = (padded.abs().amax(dim=2) / (mid - 1)).clamp_min(1e-12)  # (N, G)
        zero = torch.full_like(scale, mid)
    else:
        lo, hi = padded.amin(dim=2).clamp(max=0), padded.amax(dim=2).clamp(min=0)
        scale = ((hi - lo) / top).clamp_min(1e-12)
        zero = torch.round(-lo / scale).clamp(0, top)
    idx = torch.arange(k) // group_size
    codes = torch.round(w / scale[:, idx] + zero[:, idx]).clamp(0, top).to(torch.uint8)
    kind = Kind.INT4 if bits == 4 else Kind.INT8
    return QWeight(kind, codes, scale, zero, group_size)


# A linear layer's weight as the loader hands it over: float (out, in), or a quantized
# checkpoint's projections (one QWeight each, in output order), stacked where they can be.
LinearWeight = torch.Tensor | list[QWeight]


def out_features(w: LinearWeight) -> int:
    return w.shape[0] if isinstance(w, torch.Tensor) else sum(p.shape[0] for p in w)
