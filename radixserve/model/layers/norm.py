"""RMSNorm (Llama's `w * x`, Gemma's `(1 + w) * x`, per head for QK-norm) and the residual
stream with its add + norm.

Owns: which kernel normalizes (norm_rope.py's native CPU op or torch reference; on the fused
path triton_kernels' rms_norm / fused_add_rmsnorm) and `Residual`: the residual stream of one
forward, with an output not yet added to it (`pending`) on the fused path, so that the add and
the next norm are one kernel (SGLang's fused_add_rmsnorm). Does not know: which layer it
serves, configs, weights' names.
"""

from __future__ import annotations

import torch

from radixserve.model.norm_rope import NormRope


class Residual:
    """The residual stream h (T, hidden) of one forward; on the fused path an output not yet
    added (`pending`): the next RMSNorm adds it and normalizes in one kernel."""

    def __init__(self, h: torch.Tensor, fused: bool) -> None:
        self.h = h  # (T, hidden)
        self.pending: torch.Tensor | None = None  # (T, hidden), fused path only
        self.fused = fused

    def add(self, delta: torch.Tensor) -> None:
        """h += delta (on the fused path: deferred to the next norm)."""
        if self.fused:
            if self.pending is not None:
                self.h.add_(self.pending)
            self.pending = delta
            return
        self.h = self.h + delta

    def settle(self) -> torch.Tensor:
        """h with everything added (T, hidden)."""
        if self.pending is not None:
            self.h.add_(self.pending)
            self.pending = None
        return self.h


class RMSNorm:
    """RMSNorm over the last dimension; `gemma`: HF Gemma's `x * (1 + w)` computed in fp32."""

    def __init__(self, weight: torch.Tensor, eps: float, ops: NormRope,
                 gemma: bool = False) -> None:
        self.eps, self.ops, self.gemma = eps, ops, gemma
        # Gemma: (1 + w) once, in fp32 as HF computes it; the fused kernel gets it in the
        # model dtype (exact in fp32, one rounding more in bf16).
        self.weight32 = (1.0 + weight.float()) if gemma else None  # (dim,)
        self.weight = self.weight32.to(weight.dtype) if self.weight32 is not None else weight
        # rows (T, dim) -> normalized (T, dim), the op's choices made once (not Gemma's)
        self.rows = ops.bound_rms_norm(self.weight, eps)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # (..., dim) -> (..., dim)
        if self.weight32 is not None:
            xf = x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            return (xf * self.weight32).to(x.dtype)
        if x.dim() != 2:  # per head (QK-norm): (T, heads, D) as (T * heads, D) rows
            return self.rows(x.reshape(-1, x.shape[-1])).view(x.shape)
        return self.rows(x)

    def of(self, stream: Residual, check: bool = False) -> torch.Tensor:
        """The normalized stream (T, dim), after adding what is pending (the fused kernel)."""
        if not stream.fused:
            return self(stream.h) if self.weight32 is not None else self.rows(stream.h)
        from triton_kernels.fused_add_rmsnorm import fused_add_rmsnorm, rms_norm

        x = stream.pending
        if x is None:
            return rms_norm(stream.h, self.weight, self.eps)
        stream.pending = None
        fused_add_rmsnorm(x, stream.h, self.weight, self.eps, check=check)
        return x  # normalized in place; stream.h holds the sum
