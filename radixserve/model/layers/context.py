"""ForwardContext: what every layer of one forward reads, built once per forward by the model.

Owns: the per-forward inputs (positions, attention metadata, the pool's K/V and each layer's
view of it, the 8-bit pool's scales), the attention backend, and the two choices made per
forward: fused (the residual stream kept apart and the Triton kernels' fused add-norm,
RoPE+store, silu_mul) or not, and stored (the unfused loop on CPU: each layer's RoPE and K/V
store as norm_rope's native rope_store, then the backend attends over the pool) or not.
Does not know: layers, weights, families.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from radixserve.attention.base import AttentionBackend, AttentionMetadata, StoredKVAttention
from radixserve.attention.kv_quant import KVScale
from radixserve.model.rope import RotaryTable


@dataclass(frozen=True)
class ForwardContext:
    positions: torch.Tensor  # (T,)
    meta: AttentionMetadata
    k_cache: torch.Tensor  # (layers, num_slots, kv_heads, head_dim)
    v_cache: torch.Tensor  # (layers, num_slots, kv_heads, head_dim)
    kv_scales: Sequence[KVScale] | None  # per layer, for an 8-bit KV cache
    backend: AttentionBackend
    fused: bool  # the Triton fused kernels (the backend attends over K/V the model stored)
    # (layers,) views (num_slots, kv_heads, head_dim) of k_cache / v_cache, one per layer
    k_layers: Sequence[torch.Tensor]
    v_layers: Sequence[torch.Tensor]
    stored: bool = False  # unfused, RoPE + K/V store by rope_store, then backend.attend
    # the backend where it attends over stored K/V (fused or stored), else None: checked once
    # per forward (a runtime Protocol's isinstance costs ~12 us, more than a layer's RoPE)
    attend: StoredKVAttention | None = None
    # cos/sin of the positions per rotary table, looked up once per forward, not per layer
    _cos_sin: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def cos_sin(self, table: RotaryTable) -> tuple[torch.Tensor, torch.Tensor]:
        """(T, rotary_dim) cos and signed sin of this forward's positions."""
        key = id(table)
        if key not in self._cos_sin:
            self._cos_sin[key] = table.lookup(self.positions)
        return self._cos_sin[key]

    def kv_scale(self, layer: int) -> KVScale | None:
        return None if self.kv_scales is None else self.kv_scales[layer]
