"""Attention request by request, for a batch no plan covers (torch_backend.py's fallback:
a padded block would be too large, or a lone request has no group): each request's keys
gathered from the pool and attended in one SDPA call, causal by positions.

Owns: that loop. Does not know: plans, the cascade, the native kernels, the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from radixserve.attention.base import AttentionMetadata, window_start
from radixserve.attention.kv_read import KVReader
from radixserve.attention.varlen import attend_positions


def attend_per_request(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       meta: AttentionMetadata, scale: float, reader: KVReader,
                       window: int | None, softcap: float | None) -> torch.Tensor:
    """q (T, Hq, D) of meta's requests -> out (T, Hq, D): each request's keys gathered from
    the pool (through `reader`) and attended in one call (SDPA; attend_positions with a
    window or a soft-cap)."""
    out = torch.empty_like(q)
    start = 0
    for row, prefix, n in zip(meta.rows_cpu, meta.prefix_lens_cpu, meta.extend_lens_cpu,
                              strict=True):
        total = prefix + n
        if window is not None or softcap is not None:
            lo = window_start(prefix, window)
            slots = meta.slot_table[row, lo:total]  # (total - lo,)
            dev = q.device
            out[start : start + n], _ = attend_positions(
                q[start : start + n], reader.gather(k_cache, slots, "k"),
                reader.gather(v_cache, slots, "v"), torch.arange(prefix, total, device=dev),
                torch.arange(lo, total, device=dev), scale, window, softcap)
            start += n
            continue
        slots = meta.slot_table[row, :total]  # (total,)
        keys = reader.gather(k_cache, slots, "k").transpose(0, 1).unsqueeze(0)
        values = reader.gather(v_cache, slots, "v").transpose(0, 1).unsqueeze(0)
        qb = q[start : start + n].transpose(0, 1).unsqueeze(0)  # (1, Hq, n, D)
        if prefix == 0:
            o = F.scaled_dot_product_attention(
                qb, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            qpos = torch.arange(prefix, total, device=q.device)
            kpos = torch.arange(total, device=q.device)
            o = F.scaled_dot_product_attention(
                qb, keys, values, attn_mask=kpos[None, :] <= qpos[:, None], scale=scale,
                enable_gqa=True)
        out[start : start + n] = o[0].transpose(0, 1)
        start += n
    return out
