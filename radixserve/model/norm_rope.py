"""RMSNorm and rotary embeddings as single-pass native CPU ops, and their specifications.

Owns: loading csrc/norm_rope.cpp's ops `rms_norm` / `rope_qk` at the process's CPU tier
(platform/kernels.py's NORM_ROPE: compiled without -ffast-math and without FMA contraction, so
the ops round as the torch code does), and
`rms_norm_reference` / `rope_qk_reference`: the torch code they replace, which is also the
path on CUDA with the torch attention backend (the Triton backend's forward runs
layers/' fused Triton path instead), without the build, or with RADIXSERVE_NO_CPU_KERNELS=1. Does not know: layers,
the attention backend, where the cos/sin tables come from (model/rope.py).

Why: the torch forms run 4-6 elementwise ops per call, each a pass over (and a fresh
allocation of) the whole activation, and a forward makes 91 calls (two norms per layer, the
final norm, RoPE per layer): a visible share of a distinct-prompt workload's engine time.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from radixserve.platform.kernels import ENV_DISABLE, NORM_ROPE, load_extension

__all__ = ["ENV_DISABLE"]


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's order of operations: normalize in fp32, cast back, then scale."""
    dtype = x.dtype
    if dtype == torch.float32:
        # The parity dtype: HF's exact sequence of operations.
        xf = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return xf.mul_(weight)  # weight * xf in place: the same products, one tensor fewer
    # One fp32-accumulating reduction over the bf16 input instead of upcasting it first, and
    # the fp32 scale fused into the multiply: faster than F.rms_norm on CPU, and closer to HF (it rounds once where F.rms_norm's bf16 path rounds twice).
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)  # (T, 1)
    rstd = torch.rsqrt(norm.square_().div_(x.shape[-1]).add_(eps))
    return (x * rstd).to(dtype) * weight


def rope_qk_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      heads: int) -> torch.Tensor:
    """The first `heads` head_dim-wide column groups of qkv (T, W), rotated (rotate-half, with
    `sin`'s first half negated as model/rope.py stores it): (T, heads, head_dim)."""
    d = cos.shape[-1]
    x = qkv[:, : heads * d].view(-1, heads, d)  # (T, heads, D)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # (T, 1, D)
    return x * c + torch.roll(x, d // 2, dims=-1) * s


RmsNorm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
RopeQK = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


@dataclass(frozen=True)
class NormRope:
    """The two ops a forward uses: the native ones or the references."""

    rms_norm: RmsNorm
    rope_qk: RopeQK
    native: bool


REFERENCE = NormRope(rms_norm_reference, rope_qk_reference, native=False)


def load_norm_rope(device: torch.device) -> NormRope:
    """The native ops on CPU where they build (once per process and tier), else the
    references."""
    if device.type != "cpu":
        return REFERENCE
    loaded = load_extension(NORM_ROPE)
    if loaded is None:
        return REFERENCE
    rms_norm = functools.partial(_rms_norm_native_below_fp32, loaded.op("rms_norm"))
    return NormRope(rms_norm, loaded.op("rope_qk"), native=True)


def _rms_norm_native_below_fp32(native: RmsNorm, x: torch.Tensor, weight: torch.Tensor,
                                eps: float) -> torch.Tensor:
    """fp32 keeps torch's RMSNorm: the native op adds the squares in another order (a few
    ulps), and an int8 model's greedy tokens flipped on that (tests/model/test_quant.py); with the
    pages kept (cpu_malloc.py) torch's fp32 form is cheap enough."""
    if x.dtype == torch.float32:
        return rms_norm_reference(x, weight, eps)
    out: torch.Tensor = native(x, weight, eps)
    return out
