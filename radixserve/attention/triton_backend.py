"""Attention backend on the Triton kernels (CUDA; CPU only under TRITON_INTERPRET=1).

Owns: mapping one layer's forward onto triton_kernels: store this forward's K/V, then paged
decode (split-K) or prefill (extend) attention; `attend` alone where the model stored the K/V
itself (fused with RoPE: model/layers/attention.py); an 8-bit pool's layer scales go to all
three kernels (stored = x / scale, read = stored * scale); a layer's sliding window and soft-cap
go to both attention kernels (the window is compiled in: a per-layer constant, so a CUDA graph
replays each layer's own kernel). Does not know: the model, the scheduler, how slots are
allocated. Reads only what AttentionMetadata carries; no host-device sync.
"""

from __future__ import annotations

import torch

from radixserve.attention.base import AttentionMetadata, check_window_softcap
from radixserve.attention.kv_quant import KVScale
from radixserve.types import Phase
from triton_kernels import decode_attention, extend_attention, store_kv
from triton_kernels.decode_attention import MAX_SPLITS, num_sms, splits_for


class TritonAttentionBackend:
    """`num_kv_splits` fixes decode's split-K factor; None picks one from the batch shape."""

    # Each request attends over its own slot table row; shared tree prefixes go unread.
    reads_shared_prefixes = False
    fused_kernels = True  # the model's layers run triton_kernels' fused path with it

    def __init__(self, num_kv_splits: int | None = None) -> None:
        if num_kv_splits is not None and not 1 <= num_kv_splits <= MAX_SPLITS:
            raise ValueError(f"num_kv_splits must be in [1, {MAX_SPLITS}], got {num_kv_splits}")
        self.num_kv_splits = num_kv_splits
        # The device's SM count, asked once (a per-layer query costs host time every step).
        self._sms: dict[torch.device, int | None] = {}

    def forward(
        self,
        q: torch.Tensor,  # (T, Hq, D)
        k: torch.Tensor,  # (T, Hkv, D)
        v: torch.Tensor,  # (T, Hkv, D)
        k_cache: torch.Tensor,  # (num_slots, Hkv, D), written in place
        v_cache: torch.Tensor,  # (num_slots, Hkv, D), written in place
        meta: AttentionMetadata,
        scale: float,
        kv_scale: KVScale | None = None,
        *,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:  # (T, Hq, D)
        ks, vs = (None, None) if kv_scale is None else kv_scale
        store_kv(k_cache, v_cache, k, v, meta.out_slots, ks, vs)
        return self.attend(q, k_cache, v_cache, meta, scale, kv_scale, window=window,
                           softcap=softcap)

    def attend(
        self,
        q: torch.Tensor,  # (T, Hq, D)
        k_cache: torch.Tensor,  # (num_slots, Hkv, D), this forward's K/V already stored
        v_cache: torch.Tensor,  # (num_slots, Hkv, D)
        meta: AttentionMetadata,
        scale: float,
        kv_scale: KVScale | None = None,
        *,
        window: int | None = None,
        softcap: float | None = None,
        check: bool = True,
    ) -> torch.Tensor:  # (T, Hq, D)
        """`check=False`: the decode kernel skips its operand checks (the model's later
        layers, whose operands have the first layer's shapes, dtypes and devices)."""
        check_window_softcap(window, softcap)
        ks, vs = (None, None) if kv_scale is None else kv_scale
        if meta.phase is Phase.DECODE:
            splits = self.num_kv_splits
            if splits is None:
                if q.device not in self._sms:
                    self._sms[q.device] = num_sms(q.device)
                splits = splits_for(q.shape[0], k_cache.shape[1], self._sms[q.device])
            return decode_attention(
                q, k_cache, v_cache, meta.slot_table, meta.rows, meta.seq_lens, scale,
                num_splits=splits, k_scale=ks, v_scale=vs, window=window, softcap=softcap,
                check=check,
            )
        return extend_attention(
            q, k_cache, v_cache, meta.slot_table, meta.rows, meta.prefix_lens,
            meta.extend_lens, meta.cu_extend, meta.max_extend_len, scale, k_scale=ks, v_scale=vs,
            window=window, softcap=softcap,
        )
