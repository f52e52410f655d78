"""The Llama-family decoder loop on fused Triton kernels (CUDA; CPU only under TRITON_INTERPRET=1).

Owns: the order of one forward when the attention backend can attend over K/V stored by the
model (attention/base.py's StoredKVAttention: the Triton backend), with the residual stream
kept apart from the normalized activations as SGLang's fused_add_rmsnorm keeps it.
Under tensor parallelism the model's collectives join in: an all-reduce after o_proj and down
(before the residual add), the embedding's and the LM head's (llama.py's embed_tokens, logits).
Does not know: requests, how the backend attends, the weights' layout (cpu_linear.py,
quant.py). llama.py chooses this path; its own loop stays the CPU (and torch-backend) path.

Kernel launches per decoder layer, read from the loop below (GEMMs as F.linear issues them,
a bias fused by addmm):
  1. fused_add_rmsnorm: residual += previous MLP output; x = input_norm(residual)
     (layer 0: rms_norm of the embeddings)
  2. qkv GEMM
  3. rope_qk_store: q rotated in place, rotated k and v written to the pool's slots (an
     8-bit pool: quantized there with the layer's scales, as store_kv would)
  4. attention: decode 2 (split-K + merge), prefill 1 (extend)
  5. o_proj GEMM
  6. fused_add_rmsnorm: residual += attention output; x = post_norm(residual)
  7. gate_up GEMM
  8. silu_mul
  9. down GEMM
= 10 a decode layer, 9 a prefill layer. The unfused path (llama.py on CUDA, bf16) launches 31
and 30: each RMSNorm 8 (vector_norm, square, div, add, rsqrt, mul, cast, mul; 6 in fp32), RoPE 4
(mul, roll, mul, add), store_kv 1, the o_proj and down residual adds 1 each, silu and mul 2.
Per forward, outside the layers: the embedding, the final fused_add_rmsnorm, an index_select
of the sampled rows (prefill only), the LM head and its fp32 cast (the unfused path adds two
cos/sin lookups). All graph-safe: no host sync, no allocation whose size depends on data.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch

from radixserve.attention.base import AttentionMetadata, StoredKVAttention
from radixserve.attention.kv_quant import KVScale
from triton_kernels.fused_add_rmsnorm import fused_add_rmsnorm, rms_norm
from triton_kernels.rope import rope_qk_store
from triton_kernels.silu_mul import silu_mul

if TYPE_CHECKING:
    from radixserve.model.arch import ModelArch
    from radixserve.model.rope import RotaryTable


class FusedModel(Protocol):
    """What the fused loop reads of llama.py's LlamaModel (a Protocol, so that this module
    and llama.py, which imports it lazily, form no import cycle)."""

    spec: ModelArch
    layers: Sequence[Any]  # llama.py's _Layer: norms, qkv, o_proj, mlp
    rotary: RotaryTable
    embed: torch.Tensor  # (vocab, hidden)
    final_norm: torch.Tensor  # (hidden,)
    lm_head: Any  # Linear | Int8Linear: (N, hidden) -> (N, vocab)
    q_size: int
    scale: float
    tp: Any  # TPComm | None: under tensor parallelism, the row-parallel all-reduces

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor: ...
    def logits(self, local: torch.Tensor) -> torch.Tensor: ...


def fused_forward(
    model: FusedModel,
    backend: StoredKVAttention,
    input_ids: torch.Tensor,  # (T,)
    positions: torch.Tensor,  # (T,)
    meta: AttentionMetadata,
    k_cache: torch.Tensor,  # (layers, num_slots, kv_heads, head_dim)
    v_cache: torch.Tensor,  # (layers, num_slots, kv_heads, head_dim)
    logit_rows: torch.Tensor,  # (N,)
    kv_scales: Sequence[KVScale] | None = None,  # per layer, for an 8-bit KV cache
) -> torch.Tensor:  # (N, vocab) float32
    """LlamaModel.forward's contract, on the fused kernels (llama.py calls it)."""
    spec, layers = model.spec, model.layers
    eps, num_heads = spec.rms_norm_eps, spec.num_heads
    cos, sin = model.rotary.cos, model.rotary.sin  # (max_positions, head_dim) each
    residual = model.embed_tokens(input_ids)  # (T, hidden), updated in place below
    x = rms_norm(residual, layers[0].input_norm, eps)  # (T, hidden)
    for i, layer in enumerate(layers):
        # The wrappers' argument checks cost as much host time as their launches: run them on
        # layer 0 only, whose operands have every later layer's shapes, dtypes and devices
        # (one loader, one pool); the final norm's weight is checked where it is used.
        check = i == 0
        qkv = layer.qkv(x)  # (T, q_size + 2 * kv_size)
        kv_scale = kv_scales[i] if kv_scales is not None else None
        ks, vs = (None, None) if kv_scale is None else kv_scale
        rope_qk_store(qkv, cos, sin, positions, num_heads, k_cache[i], v_cache[i],
                      meta.out_slots, ks, vs, check=check)
        q = qkv[:, : model.q_size].view(-1, num_heads, spec.head_dim)  # (T, heads, D) rotated
        attn = backend.attend(q, k_cache[i], v_cache[i], meta, model.scale,
                              kv_scale, check=check)  # (T, heads, D)
        x = layer.o_proj(attn.reshape(-1, model.q_size))  # (T, hidden)
        if model.tp is not None:  # row-parallel: the ranks' partial sums
            model.tp.all_reduce(x)
        fused_add_rmsnorm(x, residual, layer.post_norm, eps, check=check)
        x = layer.mlp.down(silu_mul(layer.mlp.gate_up_proj(x), check=check))  # (T, hidden)
        if model.tp is not None:
            model.tp.all_reduce(x)
        last = i + 1 == len(layers)
        next_norm = model.final_norm if last else layers[i + 1].input_norm
        fused_add_rmsnorm(x, residual, next_norm, eps, check=check or last)
    if logit_rows.shape[0] != x.shape[0]:
        x = x.index_select(0, logit_rows)  # (N, hidden): only the rows that sample
    logits: torch.Tensor = model.lm_head(x)  # (N, vocab, or the rank's vocabulary shard)
    return model.logits(logits.float())
