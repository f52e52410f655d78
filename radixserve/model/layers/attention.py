"""The attention block of a decoder layer, from the fused qkv projection's output to the
heads' outputs: QK-norm, rotary embeddings (full or partial), the K/V store and the call into
the AttentionBackend with the layer's scale, sliding window and logit soft-cap.

Owns: the order of those steps and the kernel for each: on the fused path (Triton backend)
RoPE and the K/V store as one kernel (triton_kernels.rope_qk_store) and backend.attend; on
the stored path (CPU, native ops, a pool in the model's dtype) likewise with norm_rope.py's
rope_store; else norm_rope.py's rope_qk (native CPU op or torch) and backend.forward; partial
rotary in torch.
Does not know: the projections (the family calls them), configs, requests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.model.layers.context import ForwardContext
from radixserve.model.layers.norm import RMSNorm
from radixserve.model.norm_rope import NormRope
from radixserve.model.rope import RotaryTable


@dataclass(frozen=True)
class AttentionShape:
    """One layer's attention: its rank's heads, and what the backend applies."""

    layer: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # softmax scale (head_dim ** -0.5, or Gemma's query_pre_attn_scalar ** -0.5)
    sliding_window: int | None = None  # attend to the last `window` tokens only
    logit_softcap: float | None = None  # scores -> cap * tanh(scores / cap) (Gemma 2)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim



def rotate_partial(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (T, H, D) with its first rotary_dim dimensions rotated (HF's partial rotary)."""
    r = cos.shape[-1]
    rot = x[..., :r]  # (T, H, r)
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)  # (T, 1, r)
    return torch.cat([rot * c + torch.roll(rot, r // 2, dims=-1) * s, x[..., r:]], dim=-1)


class Attention:
    """qkv (T, q + 2 kv) -> attention output (T, heads * head_dim)."""

    def __init__(self, shape: AttentionShape, rotary: RotaryTable, ops: NormRope,
                 q_norm: RMSNorm | None = None, k_norm: RMSNorm | None = None) -> None:
        self.shape, self.rotary, self.ops = shape, rotary, ops
        self.q_norm, self.k_norm = q_norm, k_norm

    def __call__(self, ctx: ForwardContext, qkv: torch.Tensor) -> torch.Tensor:
        s = self.shape
        if ctx.stored and not self.rotary.partial:
            return self._stored(ctx, qkv)
        if ctx.fused and not self.rotary.partial:
            return self._fused(ctx, qkv)
        qk_size = s.q_size + s.kv_size
        heads = s.num_heads + s.num_kv_heads
        cos, sin = ctx.cos_sin(self.rotary)  # (T, rotary_dim) each
        if self.q_norm is not None and self.k_norm is not None:
            q = self.q_norm(qkv[:, : s.q_size].view(-1, s.num_heads, s.head_dim))
            k = self.k_norm(qkv[:, s.q_size : qk_size].view(-1, s.num_kv_heads, s.head_dim))
            src = torch.cat([q, k], dim=1).view(-1, qk_size)  # (T, q + kv) normalized
        else:
            src = qkv
        if self.rotary.partial:
            qk = rotate_partial(src[:, :qk_size].view(-1, heads, s.head_dim), cos, sin)
        else:
            qk = self.ops.rope_qk(src, cos, sin, heads)  # (T, heads + kv_heads, D) rotated
        q, k = qk[:, : s.num_heads], qk[:, s.num_heads :]
        v = qkv[:, qk_size:].view(-1, s.num_kv_heads, s.head_dim)
        i = s.layer
        out = ctx.backend.forward(q, k, v, ctx.k_layers[i], ctx.v_layers[i], ctx.meta, s.scale,
                                  ctx.kv_scale(i), window=s.sliding_window,
                                  softcap=s.logit_softcap)
        return out.reshape(-1, s.q_size)  # (T, heads * head_dim)

    def _qk_norm_in_place(self, qkv: torch.Tensor) -> None:
        """QK-norm (Qwen3) of qkv's q and k heads, written back into qkv (T, q + 2 kv)."""
        if self.q_norm is None or self.k_norm is None:
            return
        s = self.shape
        q = qkv[:, : s.q_size].view(-1, s.num_heads, s.head_dim)
        k = qkv[:, s.q_size : s.q_size + s.kv_size].view(-1, s.num_kv_heads, s.head_dim)
        q.copy_(self.q_norm(q))
        k.copy_(self.k_norm(k))

    def _stored(self, ctx: ForwardContext, qkv: torch.Tensor) -> torch.Tensor:
        """RoPE and the K/V store in one native call (CPU), then attention over the pool: at
        batch 1 a layer's calls and their Python cost more than their arithmetic."""
        s, i = self.shape, self.shape.layer
        self._qk_norm_in_place(qkv)
        cos, sin = ctx.cos_sin(self.rotary)  # (T, head_dim) each
        k_cache, v_cache = ctx.k_layers[i], ctx.v_layers[i]
        rope_store, backend = self.ops.rope_store, ctx.attend
        assert rope_store is not None and backend is not None
        # (T, heads, D) rotated, a view of qkv
        q = rope_store(qkv, cos, sin, s.num_heads, k_cache, v_cache, ctx.meta.out_slots)
        out = backend.attend(q, k_cache, v_cache, ctx.meta, s.scale, window=s.sliding_window,
                             softcap=s.logit_softcap, check=i == 0)
        return out.reshape(-1, s.q_size)  # (T, heads * head_dim)

    def _fused(self, ctx: ForwardContext, qkv: torch.Tensor) -> torch.Tensor:
        """RoPE and the K/V store in one kernel, then attention over the stored K/V."""
        from triton_kernels.rope import rope_qk_store

        s, i = self.shape, self.shape.layer
        self._qk_norm_in_place(qkv)
        kv_scale = ctx.kv_scale(i)
        ks, vs = (None, None) if kv_scale is None else kv_scale
        # Argument checks cost as much host time as the launch: layer 0's operands have
        # every later layer's shapes, dtypes and devices.
        rope_qk_store(qkv, self.rotary.cos, self.rotary.sin, ctx.positions, s.num_heads,
                      ctx.k_layers[i], ctx.v_layers[i], ctx.meta.out_slots, ks, vs,
                      check=i == 0)
        backend = ctx.attend
        assert backend is not None
        q = qkv[:, : s.q_size].view(-1, s.num_heads, s.head_dim)  # (T, heads, D) rotated
        out = backend.attend(q, ctx.k_layers[i], ctx.v_layers[i], ctx.meta, s.scale, kv_scale,
                             window=s.sliding_window, softcap=s.logit_softcap, check=i == 0)
        return out.reshape(-1, s.q_size)
