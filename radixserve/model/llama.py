"""The Llama-family forward (Llama, Qwen2, Mistral) over a ragged batch and a paged KV pool.

Owns: the math of one forward: embeddings, RMSNorm, fused QKV + RoPE, attention through an
AttentionBackend, SwiGLU MLP, final norm and the LM head on the rows that need logits.
Does not know: requests, the scheduler, sampling. Tokens of all requests are concatenated
(no padding); the AttentionMetadata says which request each token belongs to.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.attention.base import AttentionBackend, AttentionMetadata
from radixserve.model.rope import RotaryTable
from radixserve.model.spec import ModelSpec
from radixserve.model.weights import ModelWeights


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as HF (normalize in fp32, cast back, then scale), so fp32
    # and bf16 results match the reference bit for bit where possible.
    dtype = x.dtype
    if dtype != torch.float32:
        # One fused kernel; rounding differs from HF's cast-then-scale only below bf16's
        # precision. fp32 (the parity dtype) keeps HF's exact sequence of operations.
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)


class LlamaModel:
    def __init__(self, spec: ModelSpec, weights: ModelWeights, rotary: RotaryTable,
                 backend: AttentionBackend) -> None:
        self.spec = spec
        self.w = weights
        self.rotary = rotary
        self.backend = backend
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim**-0.5

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        meta: AttentionMetadata,
        k_cache: torch.Tensor,  # (layers, num_slots, kv_heads, head_dim)
        v_cache: torch.Tensor,  # (layers, num_slots, kv_heads, head_dim)
        logit_rows: torch.Tensor,  # (N,) which token rows need logits
    ) -> torch.Tensor:  # (N, vocab) float32
        spec = self.spec
        h = F.embedding(input_ids, self.w.embed)  # (T, hidden)
        cos, sin = self.rotary.lookup(positions)  # (T, 1, head_dim) each, shared by layers
        num_qk_heads = spec.num_heads + spec.num_kv_heads
        for i, lw in enumerate(self.w.layers):
            x = rms_norm(h, lw.input_norm, spec.rms_norm_eps)
            qkv = F.linear(x, lw.qkv, lw.qkv_bias)  # (T, q_size + 2 * kv_size)
            qk = qkv[:, : self.q_size + self.kv_size].view(-1, num_qk_heads, spec.head_dim)
            qk = self.rotary.apply(qk, cos, sin)  # q and k heads rotated in one pass
            q, k = qk[:, : spec.num_heads], qk[:, spec.num_heads :]
            v = qkv[:, self.q_size + self.kv_size :].view(-1, spec.num_kv_heads, spec.head_dim)
            attn = self.backend.forward(q, k, v, k_cache[i], v_cache[i], meta, self.scale)
            h = h + F.linear(attn.reshape(-1, self.q_size), lw.o_proj)
            x = rms_norm(h, lw.post_norm, spec.rms_norm_eps)
            gate, up = F.linear(x, lw.gate_up).chunk(2, dim=-1)  # (T, intermediate) each
            h = h + F.linear(F.silu(gate) * up, lw.down)
        h = rms_norm(h[logit_rows], self.w.final_norm, spec.rms_norm_eps)  # (N, hidden)
        return F.linear(h, self.w.lm_head).float()  # (N, vocab)
