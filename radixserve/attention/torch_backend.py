"""Reference attention backend in plain torch (CPU and CUDA).

Owns: storing new K/V into the pool and attention through the slot table.
- decode: vectorized over the batch. Groups of requests that share a tree prefix
  (meta.shared) attend to it once per group (one gather, one matmul: cascade attention);
  each request's own part is gathered into a padded block and masked; the two are merged
  by log-sum-exp. Without groups, the own part is the whole sequence.
- extend: one SDPA call per request (each has its own prefix and causal offset).
Does not know: the model, the scheduler.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.attention.base import AttentionMetadata
from radixserve.types import Phase


def _partial(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
             mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over keys with its log-sum-exp, for merging partial results.

    q: (..., M, D); keys/values: (..., L, D); mask broadcastable to (..., M, L), True = keep.
    Returns out (..., M, D) float32 and lse (..., M) float32.
    """
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale  # (..., M, L)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (..., M)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return torch.matmul(probs.to(values.dtype), values).float(), lse


class TorchAttentionBackend:
    def forward(
        self,
        q: torch.Tensor,  # (T, Hq, D)
        k: torch.Tensor,  # (T, Hkv, D)
        v: torch.Tensor,  # (T, Hkv, D)
        k_cache: torch.Tensor,  # (S, Hkv, D)
        v_cache: torch.Tensor,  # (S, Hkv, D)
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        k_cache[meta.out_slots] = k
        v_cache[meta.out_slots] = v
        if meta.phase is Phase.DECODE:
            return self._decode(q, k_cache, v_cache, meta, scale)
        return self._extend(q, k_cache, v_cache, meta, scale)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        B, Hq, D = q.shape
        Hkv = k_cache.shape[1]
        G = Hq // Hkv
        qg = q.view(B, Hkv, G, D)
        # Own part: positions [own_start, seq_len) of each request, padded to the longest.
        starts = meta.own_start if meta.own_start is not None else torch.zeros_like(meta.rows)
        start_cpu = meta.own_start_cpu or (0,) * B
        own_len = max(p + 1 - s for p, s in zip(meta.prefix_lens_cpu, start_cpu, strict=False))
        pos = starts[:, None] + torch.arange(own_len, device=q.device)  # (B, own_len)
        keep = pos < meta.seq_lens[:, None]  # (B, own_len)
        pos = pos.clamp_(max=meta.slot_table.shape[1] - 1)
        slots = meta.slot_table[meta.rows[:, None], pos]  # (B, own_len)
        keys = k_cache[slots].permute(0, 2, 1, 3)  # (B, Hkv, own_len, D)
        values = v_cache[slots].permute(0, 2, 1, 3)
        out, lse = _partial(qg, keys, values, scale, keep[:, None, None, :])  # (B,Hkv,G,D)
        for group in meta.shared:
            n = group.members.shape[0]
            gk = k_cache[group.slots].transpose(0, 1)  # (Hkv, S, D)
            gv = v_cache[group.slots].transpose(0, 1)
            gq = qg[group.members].permute(1, 0, 2, 3).reshape(Hkv, n * G, D)
            o2, lse2 = _partial(gq, gk, gv, scale, None)  # (Hkv, n*G, D), (Hkv, n*G)
            o2 = o2.view(Hkv, n, G, D).permute(1, 0, 2, 3)  # (n, Hkv, G, D)
            lse2 = lse2.view(Hkv, n, G).permute(1, 0, 2)  # (n, Hkv, G)
            o1, lse1 = out[group.members], lse[group.members]
            merged = torch.logaddexp(lse1, lse2)
            out[group.members] = (o1 * torch.exp(lse1 - merged).unsqueeze(-1)
                                  + o2 * torch.exp(lse2 - merged).unsqueeze(-1))
            lse[group.members] = merged
        return out.view(B, Hq, D).to(q.dtype)

    def _extend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        start = 0
        for row, prefix, n in zip(meta.rows_cpu, meta.prefix_lens_cpu, meta.extend_lens_cpu, strict=False):
            total = prefix + n
            slots = meta.slot_table[row, :total]  # (total,)
            keys = k_cache[slots].transpose(0, 1).unsqueeze(0)  # (1, Hkv, total, D)
            values = v_cache[slots].transpose(0, 1).unsqueeze(0)
            qb = q[start : start + n].transpose(0, 1).unsqueeze(0)  # (1, Hq, n, D)
            if prefix == 0:
                o = F.scaled_dot_product_attention(
                    qb, keys, values, is_causal=True, scale=scale, enable_gqa=True
                )
            else:
                qpos = torch.arange(prefix, total, device=q.device)
                kpos = torch.arange(total, device=q.device)
                mask = kpos[None, :] <= qpos[:, None]  # (n, total)
                o = F.scaled_dot_product_attention(
                    qb, keys, values, attn_mask=mask, scale=scale, enable_gqa=True
                )
            out[start : start + n] = o[0].transpose(0, 1)
            start += n
        return out
