"""RMSNorm and rotary embeddings as single-pass native CPU ops, and their specifications.

Owns: loading csrc/norm_rope.cpp's ops `rms_norm` / `rope_qk` / `rope_store` at the process's
CPU tier (platform/kernels.py's NORM_ROPE: compiled without -ffast-math and without FMA
contraction, so the ops round as the torch code does; fp32 RMSNorm adds its squares in torch's
order, found per hidden size: NativeRmsNorm), and `rms_norm_reference` / `rope_qk_reference` /
`rope_store_reference`: the torch code they replace, which is also the path on CUDA with the
torch attention backend (the Triton backend's forward runs layers/' fused Triton path
instead), without the build, or with RADIXSERVE_NO_CPU_KERNELS=1 (rope_store has no torch
path in a forward: without the native op a layer runs rope_qk and the backend's own store).
Does not know: layers, the attention backend, where the cos/sin tables come from
(model/rope.py).

Why: the torch forms run 4-6 elementwise ops per call, each a pass over (and a fresh
allocation of) the whole activation, and a forward makes 91 calls (two norms per layer, the
final norm, RoPE per layer): a visible share of a distinct-prompt workload's engine time.
At batch 1 a call's dispatch outweighs its arithmetic, hence rope_store: a layer's RoPE and
K/V store in one call where rope_qk and two index_copy_ were three.
"""

from __future__ import annotations

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
    # the fp32 scale fused into the multiply: faster than F.rms_norm on CPU, and closer to HF
    # (it rounds once where F.rms_norm's bf16 path rounds twice).
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


def rope_store_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         q_heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slots: torch.Tensor) -> torch.Tensor:
    """qkv (T, W): q_heads q heads, then Hkv k heads and Hkv v heads (Hkv = k_cache.shape[1]),
    its q and k heads rotated in place as rope_qk_reference; then k_cache[slots] = the rotated
    k heads and v_cache[slots] = the v heads. k_cache, v_cache (S, Hkv, D); slots (T,) int64.
    Returns the rotated q heads, a (T, q_heads, D) view of qkv."""
    d, kv = cos.shape[-1], k_cache.shape[1]
    heads = q_heads + kv
    rotated = rope_qk_reference(qkv, cos, sin, heads)  # (T, heads, D)
    qkv[:, : heads * d] = rotated.view(-1, heads * d)
    k_cache.index_copy_(0, slots, rotated[:, q_heads:])
    v_cache.index_copy_(0, slots, qkv[:, heads * d : (heads + kv) * d].view(-1, kv, d))
    return qkv[:, : q_heads * d].view(-1, q_heads, d)


RmsNorm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]
RopeQK = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
RopeStore = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor,
                      torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class NormRope:
    """The ops a forward uses: the native ones or the references. `rope_store`: the native
    op only (None: the layers store K/V through the attention backend)."""

    rms_norm: RmsNorm
    rope_qk: RopeQK
    native: bool
    rope_store: RopeStore | None = None

    def bound_rms_norm(self, weight: torch.Tensor, eps: float
                       ) -> Callable[[torch.Tensor], torch.Tensor]:
        """rms_norm(x, weight, eps) of x (T, dim) in weight's dtype, its choices (the native
        op or torch, fp32's order) made now rather than per call (61 calls a decode step)."""
        if isinstance(self.rms_norm, NativeRmsNorm):
            return self.rms_norm.bound(weight, eps)
        rms_norm = self.rms_norm
        return lambda x: rms_norm(x, weight, eps)


REFERENCE = NormRope(rms_norm_reference, rope_qk_reference, native=False)


def load_norm_rope(device: torch.device) -> NormRope:
    """The native ops on CPU where they build (once per process and tier), else the
    references."""
    if device.type != "cpu":
        return REFERENCE
    loaded = load_extension(NORM_ROPE)
    if loaded is None:
        return REFERENCE
    return NormRope(NativeRmsNorm(loaded.op("rms_norm")), loaded.op("rope_qk"), native=True,
                    rope_store=loaded.op("rope_store"))


# torch's CPU sum splits one row's reduction between threads from this many elements on
# (ATen's GRAIN_SIZE, one output): another order, so such rows keep the torch form
TORCH_SPLIT_ELEMENTS = 32768
LANE_CANDIDATES = (8, 16, 4)  # widths of torch's Vectorized<float> (AVX2/default, AVX512, ...)


class NativeRmsNorm:
    """The native RMSNorm; in fp32 with its sum of squares in torch's own order, so that it
    is bit-identical to rms_norm_reference (HF's order: fp32 models' greedy tokens are
    compared with HF's, and an int8 model's flipped on a few ulps, tests/model/test_quant.py).

    torch's order follows the lane count of its vectorized sum, which its build and the CPU
    pick (8 with torch 2.13's AVX512 capability here): the first hidden size seen finds it by
    comparing the native op at each candidate with the reference, bit for bit, on random
    rows; one that matches none keeps the reference (so does a row too long for one thread's
    sum, or a row with strided elements)."""

    def __init__(self, native: Callable[..., torch.Tensor]) -> None:
        self.native = native
        self._lanes: dict[int, int | None] = {}  # hidden size -> lanes matching torch (None: none)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if x.dtype != torch.float32:
            return self.native(x, weight, eps)
        lanes = self._lanes_for(x.shape[-1])
        if lanes is None or x.stride(-1) != 1:
            return rms_norm_reference(x, weight, eps)
        return self.native(x, weight, eps, lanes)

    def bound(self, weight: torch.Tensor, eps: float) -> Callable[[torch.Tensor], torch.Tensor]:
        """This call with weight and eps fixed, for x of weight's dtype (the op checks)."""
        native = self.native
        if weight.dtype != torch.float32:
            return lambda x: native(x, weight, eps)
        lanes = self._lanes_for(weight.shape[0])
        if lanes is None:
            return lambda x: rms_norm_reference(x, weight, eps)
        return lambda x: (native(x, weight, eps, lanes) if x.stride(-1) == 1
                          else rms_norm_reference(x, weight, eps))

    def _lanes_for(self, hidden: int) -> int | None:
        """The lane count matching torch's fp32 sum at this hidden size, found once."""
        if hidden not in self._lanes:
            self._lanes[hidden] = self._torch_lanes(hidden)
        return self._lanes[hidden]

    def _torch_lanes(self, hidden: int) -> int | None:
        if hidden >= TORCH_SPLIT_ELEMENTS:
            return None
        gen = torch.Generator().manual_seed(hidden)
        # rows of very different scales, so that a different order shows in the last bits
        x = torch.randn(64, hidden, generator=gen) * torch.rand(64, 1, generator=gen) * 8
        w = torch.rand(hidden, generator=gen) + 0.5
        ref = rms_norm_reference(x, w, 1e-5)
        for lanes in LANE_CANDIDATES:
            if torch.equal(self.native(x, w, 1e-5, lanes), ref):
                return lanes
        return None
