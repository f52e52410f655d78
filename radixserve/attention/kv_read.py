"""Reading K/V rows out of the pool for the torch paths: reused buffers, and dequantizing an
8-bit pool on the way out.

Owns: Scratch (the buffers gathers reuse) and KVReader (a gather or a consecutive view, in the
attention dtype: for an 8-bit pool, the rows read are converted with the layer's scales, so
only what one attention call reads exists in full precision, never the pool). Does not know:
plans, metadata, which rows a path needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.attention.kv_quant import KVScale, dequantize


class Scratch:
    """Reused buffers that K/V are gathered into from the pool.

    A gather into fresh memory pays the page faults of a new multi-MB tensor on every layer;
    a reused buffer avoids them (figures: bench/README.md). Invariant: what gather() returns is
    consumed before the next gather of that key.
    """

    def __init__(self) -> None:
        self._bufs: dict[str, torch.Tensor] = {}

    def gather(self, cache: torch.Tensor, slots: torch.Tensor, key: str) -> torch.Tensor:
        """cache (S, Hkv, D)[slots] -> (len(slots), Hkv, D), in a buffer reused per key."""
        n, row = slots.shape[0], cache[0].numel()
        buf = self._bufs.get(key)
        if buf is None or buf.numel() < n * row or buf.dtype != cache.dtype or (
                buf.device != cache.device):
            buf = torch.empty(n * row, dtype=cache.dtype, device=cache.device)
            self._bufs[key] = buf
        out = buf[: n * row].view(n, row)
        torch.index_select(cache.view(cache.shape[0], row), 0, slots, out=out)
        return out.view(n, *cache.shape[1:])


@dataclass(frozen=True)
class KVReader:
    """Rows of one layer's k_cache ("k") or v_cache ("v") in `dtype`; kv_scale is set when the
    pool is 8-bit (then the rows are dequantized: stored * scale of their KV head)."""

    scratch: Scratch
    kv_scale: KVScale | None
    dtype: torch.dtype

    def gather(self, cache: torch.Tensor, slots: torch.Tensor, key: str) -> torch.Tensor:
        """cache[slots] -> (len(slots), Hkv, D)."""
        return self._dequantized(self.scratch.gather(cache, slots, key), key)

    def narrow(self, cache: torch.Tensor, first: int, length: int, key: str) -> torch.Tensor:
        """cache[first : first + length] -> (length, Hkv, D); a view of a full-precision pool."""
        return self._dequantized(cache.narrow(0, first, length), key)

    def _dequantized(self, rows: torch.Tensor, key: str) -> torch.Tensor:
        if self.kv_scale is None:
            return rows
        scale = self.kv_scale.k if key == "k" else self.kv_scale.v
        return dequantize(rows, scale, self.dtype)
