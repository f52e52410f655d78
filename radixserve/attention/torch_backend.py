"""Reference attention backend in plain torch (CPU and CUDA), with cascade attention over
shared tree prefixes.

Owns: storing new K/V into the pool and attention through the slot table.
Each request's keys are split in two parts, merged by log-sum-exp:
- the group part: a tree prefix shared by a group of requests (meta.shared), attended once
  for all the group's query tokens (one gather, one matmul) instead of once per request;
- the own part: positions [own_start, seq_len), gathered into one padded block for the whole
  batch and masked (causal inside the request's new tokens).
A batch whose padded block would be too large (a long prompt next to short ones) falls back
to one SDPA call per request. The plan (indices, masks) is built once per forward and reused
by every layer. Does not know: the model, the scheduler.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.attention.base import AttentionMetadata

MAX_PADDED_ELEMENTS = 1 << 22  # B * max_new * max_own; past it the padding costs too much


def _partial(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
             keep: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over part of the keys, with its log-sum-exp for merging.

    q: (..., M, D); keys/values: (..., L, D); keep: broadcastable to (..., M, L), True = attend.
    Returns out (..., M, D) float32 and lse (..., M) float32.
    """
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale  # (..., M, L)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (..., M)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return torch.matmul(probs.to(values.dtype), values).float(), lse


@dataclass
class _Group:
    token_rows: torch.Tensor  # (N,) rows of q of every token of the group's requests
    slots: torch.Tensor  # (S,) the shared prefix


@dataclass
class _Plan:
    """Indices and masks of one forward, shared by all layers."""

    q_index: torch.Tensor  # (B, Nq) row of q for each padded query (0 where invalid)
    q_valid: torch.Tensor  # (B, Nq) bool
    own_slots: torch.Tensor  # (B, Lo) slots of each request's own part (clamped, valid)
    keep: torch.Tensor  # (B, 1, Nq, 1, Lo) bool
    groups: list[_Group]


def _make_plan(meta: AttentionMetadata) -> _Plan | None:
    B, dev = meta.batch_size, meta.rows.device
    starts_cpu = meta.own_start_cpu or (0,) * B
    nq = meta.max_extend_len
    own_len = max(p + n - s for p, n, s in
                  zip(meta.prefix_lens_cpu, meta.extend_lens_cpu, starts_cpu, strict=True))
    if B * nq * own_len > MAX_PADDED_ELEMENTS and B > 1:
        return None
    starts = meta.own_start if meta.own_start is not None else torch.zeros_like(meta.rows)
    j = torch.arange(nq, device=dev)
    q_valid = j[None, :] < meta.extend_lens[:, None]  # (B, Nq)
    q_index = torch.where(q_valid, meta.cu_extend[:-1, None] + j[None, :], 0)
    q_pos = meta.prefix_lens[:, None] + j[None, :]  # (B, Nq) absolute positions
    k_pos = starts[:, None] + torch.arange(own_len, device=dev)  # (B, Lo)
    keep = k_pos[:, None, :] <= q_pos[:, :, None]  # (B, Nq, Lo): causal; also < seq_len
    keep |= ~q_valid[:, :, None]  # padded queries attend to everything (output dropped)
    k_pos = k_pos.clamp(max=meta.slot_table.shape[1] - 1)
    own_slots = meta.slot_table[meta.rows[:, None], k_pos].long()  # (B, Lo)
    groups = []
    for g in meta.shared:
        members = g.members.tolist()
        rows = [r for b in members for r in range(sum(meta.extend_lens_cpu[:b]),
                                                  sum(meta.extend_lens_cpu[: b + 1]))]
        groups.append(_Group(torch.tensor(rows, dtype=torch.int64, device=dev), g.slots))
    return _Plan(q_index, q_valid, own_slots, keep[:, None, :, None, :], groups)


class TorchAttentionBackend:
    def __init__(self) -> None:
        # NOTE: the plan of the current forward, keyed by its metadata object; every layer of
        # one forward receives the same `meta`.
        self._plan_meta: AttentionMetadata | None = None
        self._plan: _Plan | None = None

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
        if meta is not self._plan_meta:
            self._plan_meta, self._plan = meta, _make_plan(meta)
        if self._plan is None:
            return self._per_request(q, k_cache, v_cache, meta, scale)
        return self._cascade(q, k_cache, v_cache, self._plan, scale)

    def _cascade(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 plan: _Plan, scale: float) -> torch.Tensor:
        T, Hq, D = q.shape
        Hkv = k_cache.shape[1]
        G = Hq // Hkv
        B, Nq = plan.q_index.shape
        qp = q[plan.q_index].view(B, Nq, Hkv, G, D).permute(0, 2, 1, 3, 4)  # (B,Hkv,Nq,G,D)
        keys = k_cache[plan.own_slots].permute(0, 2, 1, 3)  # (B, Hkv, Lo, D)
        values = v_cache[plan.own_slots].permute(0, 2, 1, 3)
        scores_q = qp.reshape(B, Hkv, Nq * G, D)
        out, lse = _partial(scores_q, keys, values, scale,
                            plan.keep.expand(B, 1, Nq, G, -1).reshape(B, 1, Nq * G, -1))
        out = out.view(B, Hkv, Nq, G, D).permute(0, 2, 1, 3, 4)[plan.q_valid]  # (T,Hkv,G,D)
        lse = lse.view(B, Hkv, Nq, G).permute(0, 2, 1, 3)[plan.q_valid]  # (T, Hkv, G)
        for g in plan.groups:
            n = g.token_rows.shape[0]
            gk = k_cache[g.slots].transpose(0, 1)  # (Hkv, S, D)
            gv = v_cache[g.slots].transpose(0, 1)
            gq = q[g.token_rows].view(n, Hkv, G, D).permute(1, 0, 2, 3).reshape(Hkv, n * G, D)
            o2, lse2 = _partial(gq, gk, gv, scale, None)  # (Hkv, n*G, D), (Hkv, n*G)
            o2 = o2.view(Hkv, n, G, D).permute(1, 0, 2, 3)  # (n, Hkv, G, D)
            lse2 = lse2.view(Hkv, n, G).permute(1, 0, 2)  # (n, Hkv, G)
            o1, lse1 = out[g.token_rows], lse[g.token_rows]
            merged = torch.logaddexp(lse1, lse2)
            out[g.token_rows] = (o1 * torch.exp(lse1 - merged).unsqueeze(-1)
                                 + o2 * torch.exp(lse2 - merged).unsqueeze(-1))
            lse[g.token_rows] = merged
        return out.reshape(T, Hq, D).to(q.dtype)

    def _per_request(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     meta: AttentionMetadata, scale: float) -> torch.Tensor:
        out = torch.empty_like(q)
        start = 0
        for row, prefix, n in zip(meta.rows_cpu, meta.prefix_lens_cpu, meta.extend_lens_cpu,
                                  strict=True):
            total = prefix + n
            slots = meta.slot_table[row, :total].long()  # (total,)
            keys = k_cache[slots].transpose(0, 1).unsqueeze(0)  # (1, Hkv, total, D)
            values = v_cache[slots].transpose(0, 1).unsqueeze(0)
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
