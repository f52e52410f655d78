"""CausalLM (the forward every family shares: embed, decoder layers, final norm, LM head) and
ModelParts (what a family's layer builder gets: kernels, tables, TP, the linear method).

Owns: the per-forward choice of the fused path, the ForwardContext, the rows that reach the
LM head, and turning a layer's loaded weights into layers/ objects (one linear method, TP
wrappers, rotary tables shared per rope spec). Does not know: any family's layer order or
config fields (families/<family>.py), requests, sampling.
Tensor parallel (`tp`): built from one rank's shard (model/tp_shard.py): the vocabulary-
parallel embedding's all-reduce, one all-reduce per row-parallel projection (o_proj, down)
and the gather of the LM head's vocabulary shards to rank 0 (layers/).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from radixserve.attention.base import AttentionBackend, AttentionMetadata, StoredKVAttention
from radixserve.attention.kv_quant import KVScale
from radixserve.model.arch import ModelArch, RopeSpec
from radixserve.model.layers.attention import Attention, AttentionShape
from radixserve.model.layers.context import ForwardContext
from radixserve.model.layers.embedding import LMHead, VocabEmbedding
from radixserve.model.layers.linear import (
    LinearLayer,
    LinearMethod,
    LoraHook,
    RowParallelLinear,
)
from radixserve.model.layers.mlp import GatedMLP
from radixserve.model.layers.norm import Residual, RMSNorm
from radixserve.model.norm_rope import NormRope, RopeStore, load_norm_rope
from radixserve.model.quantization.qweight import out_features
from radixserve.model.rope import RotaryTable
from radixserve.model.weights import LayerWeights, ModelWeights

if TYPE_CHECKING:
    from radixserve.model.tp_shard import TPShard
    from radixserve.parallel.comm import TPComm


class DecoderLayer(Protocol):
    @property
    def nbytes(self) -> int: ...  # its linear weights' bytes

    def forward(self, ctx: ForwardContext, stream: Residual) -> None: ...


@dataclass
class ModelParts:
    """What building a family's layers needs beside the weights (one per model)."""

    spec: ModelArch  # this rank's (its heads and MLP width under TP)
    method: LinearMethod
    ops: NormRope
    tp: TPComm | None
    fused: bool  # built for the fused path: gate/up not split for oneDNN's epilogues
    max_positions: int
    dtype: torch.dtype
    device: torch.device
    _tables: dict[RopeSpec, RotaryTable]
    # --enable-lora: every projection carries this hook, and gate/up stay one GEMM (the
    # adapters' delta goes between it and the activation: no oneDNN epilogue halves)
    lora: LoraHook | None = None

    def rotary(self, rope: RopeSpec) -> RotaryTable:
        """The table of `rope`, one per distinct spec (Gemma 3: a local and a global one)."""
        if rope not in self._tables:
            self._tables[rope] = RotaryTable(rope, self.spec.head_dim, self.max_positions,
                                             self.dtype, self.device)
        return self._tables[rope]

    def norm(self, weight: torch.Tensor, gemma: bool = False) -> RMSNorm:
        return RMSNorm(weight, self.spec.rms_norm_eps, self.ops, gemma)

    def qkv(self, i: int, lw: LayerWeights) -> LinearLayer:
        s = self.spec
        kv = s.num_kv_heads * s.head_dim
        return LinearLayer(self.method.create(lw.qkv, lw.qkv_bias), "qkv_proj", i,
                           (s.num_heads * s.head_dim, kv, kv), self.lora)

    def o_proj(self, i: int, lw: LayerWeights) -> RowParallelLinear:
        return RowParallelLinear(self.method.create(lw.o_proj, None), "o_proj", i,
                                 (self.spec.hidden_size,), self.lora, tp=self.tp)

    def attention(self, i: int, rope: RopeSpec, scale: float | None = None,
                  window: int | None = None, softcap: float | None = None,
                  qk_norm: tuple[RMSNorm, RMSNorm] | None = None) -> Attention:
        s = self.spec
        # A window no request can outgrow attends like a full layer: drop it.
        window = window if window is not None and window < self.max_positions else None
        shape = AttentionShape(i, s.num_heads, s.num_kv_heads, s.head_dim,
                               s.head_dim**-0.5 if scale is None else scale, window, softcap)
        q_norm, k_norm = qk_norm if qk_norm is not None else (None, None)
        return Attention(shape, self.rotary(rope), self.ops, q_norm, k_norm)

    def mlp(self, i: int, lw: LayerWeights, act: str = "silu") -> GatedMLP:
        assert lw.gate_up is not None and lw.down is not None, f"layer {i} is sparse (MoE)"
        down = RowParallelLinear(self.method.create(lw.down, None), "down_proj", i,
                                 (self.spec.hidden_size,), self.lora, tp=self.tp)
        packed = None if self.fused or act != "silu" or self.lora is not None else (
            self.method.swiglu(lw.gate_up))
        if packed is not None:
            return GatedMLP(None, down, act, packed)
        inter = out_features(lw.gate_up) // 2
        gate_up = LinearLayer(self.method.create(lw.gate_up, None, prepacked=not self.fused),
                              "gate_up_proj", i, (inter, inter), self.lora)
        return GatedMLP(gate_up, down, act)


@dataclass(frozen=True)
class PoolViews:
    """A forward's fixed part: the backend as a StoredKVAttention or None (a runtime
    Protocol's isinstance costs ~12 us) and the pool's per-layer views (two selects per layer
    and forward otherwise)."""

    backend: AttentionBackend
    attend: StoredKVAttention | None
    k_cache: torch.Tensor  # (layers, num_slots, kv_heads, head_dim)
    v_cache: torch.Tensor
    k_layers: tuple[torch.Tensor, ...]  # (num_slots, kv_heads, head_dim) each
    v_layers: tuple[torch.Tensor, ...]


class CausalLM:
    """A decoder-only LM: `forward` maps a ragged batch to the sampled rows' logits."""

    def __init__(self, spec: ModelArch, embed: VocabEmbedding, layers: Sequence[DecoderLayer],
                 final_norm: RMSNorm, lm_head: LMHead, backend: AttentionBackend,
                 fused: bool, rope_store: RopeStore | None = None) -> None:
        self.spec, self.embed_tokens, self.layers = spec, embed, list(layers)
        self.final_norm, self.lm_head = final_norm, lm_head
        self.backend = backend  # kv_calibration swaps it for one forward
        self.fused = fused
        # norm_rope's native RoPE + K/V store (CPU; the layers' own ops): the stored path
        self.rope_store = rope_store
        self._views: PoolViews | None = None

    @property
    def embed(self) -> torch.Tensor:  # (vocab or the rank's shard, hidden)
        return self.embed_tokens.weight

    def linear_weight_bytes(self) -> tuple[int, int]:
        """(bytes of the decoder layers' linear weights, bytes of the LM head's weight)."""
        return sum(layer.nbytes for layer in self.layers), self.lm_head.nbytes

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
    ) -> torch.Tensor:  # (N, vocab) float32
        pool = self._pool_views(k_cache, v_cache)
        # A backend without attend() (e.g. calibration's recorder) runs the unfused order.
        fused = self.fused and pool.attend is not None
        # the stored path: a pool in the model's dtype (rope_store does not quantize)
        stored = (not fused and pool.attend is not None and self.rope_store is not None
                  and kv_scales is None and k_cache.dtype == self.embed.dtype)
        ctx = ForwardContext(positions, meta, k_cache, v_cache, kv_scales, pool.backend, fused,
                             pool.k_layers, pool.v_layers, stored, pool.attend)
        stream = Residual(self.embed_tokens(input_ids), fused)  # (T, hidden)
        for layer in self.layers:
            layer.forward(ctx, stream)
        if fused:
            x = self.final_norm.of(stream, check=True)  # (T, hidden)
            if logit_rows.shape[0] != x.shape[0]:
                x = x.index_select(0, logit_rows)  # (N, hidden): only the rows that sample
            return self.lm_head(x)
        h = stream.settle()
        if logit_rows.shape[0] != h.shape[0]:
            h = h.index_select(0, logit_rows)  # (N, hidden)
        return self.lm_head(self.final_norm(h))  # (N, vocab)


    def _pool_views(self, k_cache: torch.Tensor, v_cache: torch.Tensor) -> PoolViews:
        """What stays while the backend and the pool do, made once rather than per forward."""
        views = self._views
        if (views is None or views.backend is not self.backend or views.k_cache is not k_cache
                or views.v_cache is not v_cache):
            backend = self.backend
            attend = backend if isinstance(backend, StoredKVAttention) else None
            views = self._views = PoolViews(backend, attend, k_cache, v_cache,
                                            k_cache.unbind(0), v_cache.unbind(0))
        return views


def model_parts(spec: ModelArch, method: LinearMethod, max_positions: int,
                dtype: torch.dtype, device: torch.device, fused: bool,
                tp: TPComm | None, lora: LoraHook | None = None) -> ModelParts:
    return ModelParts(spec, method, load_norm_rope(device), tp, fused, max_positions, dtype,
                      device, {}, lora)


def head_and_embed(parts: ModelParts, weights: ModelWeights, shard: TPShard | None,
                   quantize_lm_head: bool, embed_scale: float | None = None,
                   softcap: float | None = None) -> tuple[VocabEmbedding, LMHead]:
    """The embedding and LM head (tied embeddings: the packed or int8 LM head is a second
    layout of the embedding, worth it since the head is a step's largest single matmul)."""
    vocab_range = None if shard is None else shard.vocab_range
    embed = VocabEmbedding(weights.embed, vocab_range, parts.tp, embed_scale)
    method = parts.method if quantize_lm_head else None
    from radixserve.model.layers.linear import FloatMethod

    kernel = (method or FloatMethod()).create(weights.lm_head, None)
    return embed, LMHead(kernel, parts.spec.vocab_size, parts.tp, softcap)
