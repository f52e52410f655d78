"""The 8-bit KV cache format: storage dtypes, per-(layer, KV head) scales, quantize/dequantize.

Owns: what `--kv-cache-dtype` means for the bytes in the pool (vLLM's names: fp8 = fp8_e4m3 =
torch.float8_e4m3fn, fp8_e5m2 = torch.float8_e5m2), the rule stored = clamp(x / scale) cast
to 8 bits and read = stored * scale, with one fp32 scale per (layer, KV head) for K and one for
V, and the scales a calibration amax gives. The kernels (csrc/, triton_kernels/) implement the
same rule; these torch functions are their reference and the torch backend's path. Does not
know: where the scales come from (engine/kv_calibration.py), the pool's layout.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

KV_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
# The calibration text's amax maps to this fraction of the format's largest value: later text
# may reach past what calibration saw (such a value saturates), and the headroom costs e4m3 /
# e5m2 only their smallest subnormals (their precision is relative, not absolute).
AMAX_HEADROOM = 2.0


class KVScale(NamedTuple):
    """One layer's scales: k, v (Hkv,) float32 on the pool's device."""

    k: torch.Tensor
    v: torch.Tensor


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The pool's element dtype for a --kv-cache-dtype value ("auto": the model's)."""
    return model_dtype if kv_cache_dtype == "auto" else KV_DTYPES[kv_cache_dtype]


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES


def fp8_max(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).max)


def scales_from_amax(amax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """amax (..., Hkv) of calibration K or V -> scales (..., Hkv) float32 (never 0)."""
    return (amax.float() * AMAX_HEADROOM / fp8_max(dtype)).clamp(min=1e-8)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (T, Hkv, D) -> (T, Hkv, D) in `dtype`: x / scale[h], saturated to the format's range
    (e4m3 has no infinity, e5m2's would poison the softmax)."""
    limit = fp8_max(dtype)
    y = x.float() / scale[None, :, None]  # (T, Hkv, D)
    return y.clamp_(-limit, limit).to(dtype)


def dequantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x (..., Hkv, D) 8-bit -> (..., Hkv, D) in `dtype`: x * scale[h] (computed in fp32)."""
    return (x.float() * scale[:, None]).to(dtype)


def store(cache: torch.Tensor, slots: torch.Tensor, x: torch.Tensor,
          scale: torch.Tensor | None) -> None:
    """cache[slots] = x, quantized with `scale` when the cache is 8-bit (then scale is set).
    cache (S, Hkv, D), slots (T,) int64, x (T, Hkv, D) in the model's dtype."""
    if not is_fp8(cache.dtype):
        cache.index_copy_(0, slots, x)
        return
    assert scale is not None, "an 8-bit KV cache needs its scales"
    # torch has no index_copy_ for float8 on CPU: the bytes are copied instead.
    cache.view(torch.uint8).index_copy_(0, slots, quantize(x, scale, cache.dtype).view(torch.uint8))
