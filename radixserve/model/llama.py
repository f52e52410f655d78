"""The Llama-family forward (Llama, Qwen2, Mistral) over a ragged batch and a paged KV pool.

Owns: the math of one forward: embeddings, RMSNorm, fused QKV + RoPE (those two through
norm_rope.py's ops), attention through an
AttentionBackend, SwiGLU MLP, final norm and the LM head on the rows that need logits, and
which rows reach the LM head. The linear layers' weight layout is cpu_linear.py's (prepacked
for oneDNN on CPU) or quant.py's (int8).
With a backend that attends over K/V the model stores (the Triton backend, i.e. CUDA), the
forward runs as fused_forward.py's loop instead: RMSNorm with the residual add, RoPE with the
KV store and SiLU * up as one kernel each (launch counts in that module's docstring).
Tensor parallel (`tp`): built from one rank's shard (model/tp_shard.py), the forward adds the
collectives: the vocabulary-parallel embedding's all-reduce, one all-reduce after each
row-parallel projection (o_proj, down; rank 0 alone adds the residual, so the sum is the new
residual on every rank) and the gather of the LM head's vocabulary shards to rank 0.
Does not know: requests, the scheduler, sampling. Tokens of all requests are concatenated
(no padding); the AttentionMetadata says which request each token belongs to.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixserve.attention.base import AttentionBackend, AttentionMetadata, StoredKVAttention
from radixserve.attention.kv_quant import KVScale
from radixserve.model.arch import ModelArch
from radixserve.model.cpu_linear import GatedMLP, Linear, make_linear
from radixserve.model.int8_kernel import load_int8_gemm
from radixserve.model.lora_delta import LoRABatch
from radixserve.model.norm_rope import load_norm_rope
from radixserve.model.quant import Int8Linear
from radixserve.model.rope import RotaryTable
from radixserve.model.weights import ModelWeights

if TYPE_CHECKING:
    from radixserve.model.tp_shard import TPShard
    from radixserve.parallel.comm import TPComm


@dataclass
class _Layer:
    input_norm: torch.Tensor  # (hidden,)
    qkv: Linear | Int8Linear  # hidden -> (heads + 2 * kv_heads) * head_dim
    o_proj: Linear | Int8Linear  # heads * head_dim -> hidden
    post_norm: torch.Tensor  # (hidden,)
    mlp: GatedMLP


FusedForward = Callable[..., torch.Tensor]  # fused_forward.fused_forward's signature


def _load_fused(backend: AttentionBackend, fused: bool | None) -> FusedForward | None:
    """fused_forward where the backend can attend over stored K/V (None: decide from it)."""
    if fused is None:
        fused = isinstance(backend, StoredKVAttention)
    if not fused:
        return None
    if not isinstance(backend, StoredKVAttention):
        raise ValueError(f"fused kernels need a backend with attend(), not {type(backend)}")
    # Imported here: it imports triton, which the CPU path never needs.
    from radixserve.model.fused_forward import fused_forward

    return fused_forward


class LlamaModel:
    """`fused`: the fused-kernel forward (fused_forward.py); None: on where the backend
    supports it (the Triton backend), False: llama.py's own loop with any backend."""

    def __init__(self, spec: ModelArch, weights: ModelWeights, rotary: RotaryTable,
                 backend: AttentionBackend, quantization: str | None = None,
                 quantize_lm_head: bool = True, fused: bool | None = None,
                 tp: TPComm | None = None, shard: TPShard | None = None) -> None:
        """With `tp`: `spec` is the rank's own (shard.local_arch()), the weights its slices."""
        self.spec = spec
        self.tp, self.shard = tp, shard
        # The rank that adds the residual into a row-parallel projection's partial sum.
        self.adds_residual = tp is None or tp.is_lead
        self.rotary = rotary
        self.backend = backend
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim**-0.5
        # RMSNorm and RoPE: native single-pass ops on CPU where they build, else torch's
        self.ops = load_norm_rope(weights.embed.device)
        self.fused = _load_fused(backend, fused)
        # NOTE: the loaded ModelWeights is not kept: its layer weights live on only in their
        # (possibly prepacked) Linear, so the model holds one copy of each.
        self.embed = weights.embed  # (vocab, hidden)
        self.final_norm = weights.final_norm  # (hidden,)
        q = quantization
        # One load (or one failed build) of the int8 kernel for every layer, not one each.
        gemm = load_int8_gemm() if q == "int8" and self.embed.device.type == "cpu" else None
        self.layers = [
            _Layer(lw.input_norm, make_linear(lw.qkv, lw.qkv_bias, q, int8_gemm=gemm),
                   make_linear(lw.o_proj, None, q, int8_gemm=gemm), lw.post_norm,
                   # The fused path needs gate_up as one GEMM: no prepacked halves (CPU only).
                   GatedMLP(lw.gate_up, lw.down, q, prepacked=self.fused is None,
                            int8_gemm=gemm))
            for lw in weights.layers
        ]
        # Tied embeddings: the packed (or int8) LM head is a second layout of the embedding
        # (+vocab x hidden), worth it since the head is the largest single matmul of a step.
        self.lm_head = make_linear(weights.lm_head, None, q if quantize_lm_head else None,
                                   int8_gemm=gemm)

    def linear_weight_bytes(self) -> tuple[int, int]:
        """(bytes of the decoder layers' linear weights, bytes of the LM head's weight)."""
        layers = sum(lay.qkv.nbytes + lay.o_proj.nbytes + lay.mlp.nbytes for lay in self.layers)
        return layers, self.lm_head.nbytes

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # (T,)
        positions: torch.Tensor,  # (T,)
        meta: AttentionMetadata,
        k_cache: torch.Tensor,  # (layers, num_slots, kv_heads, head_dim)
        v_cache: torch.Tensor,  # (layers, num_slots, kv_heads, head_dim)
        logit_rows: torch.Tensor,  # (N,) which token rows need logits
        kv_scales: Sequence[KVScale] | None = None,  # per layer, for an 8-bit KV cache
        lora: LoRABatch | None = None,  # the step's adapter segments (None: base model only)
    ) -> torch.Tensor:  # (N, vocab) float32
        if lora is not None:
            return self._forward_lora(input_ids, positions, meta, k_cache, v_cache, logit_rows,
                                      kv_scales, lora)
        if self.fused is not None:  # an 8-bit pool too: the fused store quantizes
            return self.fused(self, self.backend, input_ids, positions, meta, k_cache, v_cache,
                              logit_rows, kv_scales)
        spec, norm, rope = self.spec, self.ops.rms_norm, self.ops.rope_qk
        eps = spec.rms_norm_eps
        h = self.embed_tokens(input_ids)  # (T, hidden)
        cos, sin = self.rotary.lookup(positions)  # (T, head_dim) each, shared by layers
        num_qk_heads = spec.num_heads + spec.num_kv_heads
        qk_size = self.q_size + self.kv_size
        for i, layer in enumerate(self.layers):
            qkv = layer.qkv(norm(h, layer.input_norm, eps))  # (T, q_size + 2 * kv_size)
            qk = rope(qkv, cos, sin, num_qk_heads)  # (T, heads + kv_heads, head_dim) rotated
            q, k = qk[:, : spec.num_heads], qk[:, spec.num_heads :]
            v = qkv[:, qk_size:].view(-1, spec.num_kv_heads, spec.head_dim)
            attn = self.backend.forward(q, k, v, k_cache[i], v_cache[i], meta, self.scale,
                                        None if kv_scales is None else kv_scales[i])
            attn = attn.reshape(-1, self.q_size)  # (T, heads * head_dim)
            if self.tp is None:
                h = layer.o_proj.add_to(h, attn)  # (T, hidden)
                h = layer.mlp(norm(h, layer.post_norm, eps), h)
                continue
            part = layer.o_proj.add_to(h, attn) if self.adds_residual else layer.o_proj(attn)
            h = self.tp.all_reduce(part)  # (T, hidden): h + the sum of the ranks' partials
            x = norm(h, layer.post_norm, eps)
            h = self.tp.all_reduce(layer.mlp(x, h if self.adds_residual else None))
        if logit_rows.shape[0] != h.shape[0]:
            h = h.index_select(0, logit_rows)  # (N, hidden): only the rows that sample
        return self.logits(self.lm_head(norm(h, self.final_norm, eps)).float())  # (N, vocab)

    def _forward_lora(self, input_ids: torch.Tensor, positions: torch.Tensor,
                      meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      logit_rows: torch.Tensor, kv_scales: Sequence[KVScale] | None,
                      lora: LoRABatch) -> torch.Tensor:  # (N, vocab) float32
        """forward's own loop with each linear layer's LoRA deltas added to its output (the
        step's adapter segments; base rows get none). Single rank, unfused (EngineConfig)."""
        assert self.tp is None, "LoRA with tensor parallelism is refused at the edge"
        spec, norm, rope = self.spec, self.ops.rms_norm, self.ops.rope_qk
        eps = spec.rms_norm_eps
        h = self.embed_tokens(input_ids)  # (T, hidden)
        cos, sin = self.rotary.lookup(positions)  # (T, head_dim) each
        qk_size = self.q_size + self.kv_size
        for i, layer in enumerate(self.layers):
            x = norm(h, layer.input_norm, eps)  # (T, hidden)
            qkv = layer.qkv(x)  # (T, q_size + 2 * kv_size)
            lora.add_delta(i, "qkv", x, qkv)
            qk = rope(qkv, cos, sin, spec.num_heads + spec.num_kv_heads)
            q, k = qk[:, : spec.num_heads], qk[:, spec.num_heads :]
            v = qkv[:, qk_size:].view(-1, spec.num_kv_heads, spec.head_dim)
            attn = self.backend.forward(q, k, v, k_cache[i], v_cache[i], meta, self.scale,
                                        None if kv_scales is None else kv_scales[i])
            attn = attn.reshape(-1, self.q_size)  # (T, heads * head_dim)
            h = layer.o_proj.add_to(h, attn)  # (T, hidden)
            lora.add_delta(i, "o", attn, h)
            h = layer.mlp.with_deltas(norm(h, layer.post_norm, eps), h,
                                      lambda t, xi, yi, i=i: lora.add_delta(i, t, xi, yi))
        if logit_rows.shape[0] != h.shape[0]:
            h = h.index_select(0, logit_rows)  # (N, hidden)
        return self.logits(self.lm_head(norm(h, self.final_norm, eps)).float())  # (N, vocab)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:  # (T,) -> (T, hidden)
        if self.tp is None:
            return F.embedding(input_ids, self.embed)
        assert self.shard is not None
        start, end = self.shard.vocab_range
        local = input_ids - start  # (T,)
        outside = (input_ids < start) | (input_ids >= end)  # (T,) another rank's row
        h = F.embedding(local.masked_fill(outside, 0), self.embed)  # (T, hidden)
        h.masked_fill_(outside.unsqueeze(1), 0.0)
        return self.tp.all_reduce(h)  # exactly one rank contributes each row: no rounding

    def logits(self, local: torch.Tensor) -> torch.Tensor:
        """(N, vocab) float32: the LM head's output, or under TP on rank 0 the ranks' shards
        gathered (the other ranks get their own shard back)."""
        if self.tp is None:
            return local
        return self.tp.gather_vocab(local, self.spec.vocab_size)
