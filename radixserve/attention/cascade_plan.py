"""The cascade's per-forward plans: which keys each query attends and how they are read.

Owns: `make_plan` (the padded cascade: the own parts' slots gathered into one (B, Lo) block,
the causal / window / padding mask, the shared groups) and `make_decode_plan` (one native
kernel row per new token, keys read in place), and `plan_groups` (the shared tree prefixes).
A plan is built once per forward (per sliding window) and read by every layer.
Does not know: attention itself, the pool's dtype or its quantization (torch_backend.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.attention.base import AttentionMetadata, window_start
from radixserve.attention.kv_read import KVReader
from radixserve.attention.varlen import token_offsets

MAX_PADDED_ELEMENTS = 1 << 22  # B * max_new * max_own; past it the padding costs too much


@dataclass
class Group:
    token_rows: torch.Tensor | None  # (N,) rows of q of the group's tokens; None: all tokens
    slots: torch.Tensor  # (S,) the shared prefix
    first_slot: int | None  # set when the slots are consecutive: a view replaces the gather

    def keys(self, cache: torch.Tensor, reader: KVReader, key: str) -> torch.Tensor:
        """(S, Hkv, D): a view where the slots are consecutive, else a gather."""
        if self.first_slot is not None:
            return reader.narrow(cache, self.first_slot, self.slots.shape[0], key)
        return reader.gather(cache, self.slots, key)


@dataclass
class CascadePlan:
    """Indices and mask of one forward, shared by all layers."""

    num_reqs: int  # B
    max_new: int  # Nq: padded new tokens per request
    own_len: int  # Lo: padded own keys per request
    q_rows: torch.Tensor | None  # (B * Nq,) row of q of each padded query; None: no padding
    out_rows: torch.Tensor | None  # (T,) padded row of each token; None: no padding
    own_slots: torch.Tensor  # (B * Lo,) slots of each request's own part (clamped, valid)
    mask: torch.Tensor | None  # (B, 1, Nq * G, Lo) additive; None: nothing to mask
    groups: list[Group]


def make_plan(meta: AttentionMetadata, group_size: int, dtype: torch.dtype,
               window: int | None) -> CascadePlan | None:
    """The padded cascade plan, or None for one SDPA call per request. With a window (meta
    without groups), each request's own part starts at its first query's window."""
    B, dev = meta.batch_size, meta.rows.device
    starts_cpu = meta.own_start_cpu or (0,) * B
    starts = meta.own_start if meta.own_start is not None else torch.zeros_like(meta.rows)
    if window is not None:
        starts_cpu = tuple(window_start(p, window) for p in meta.prefix_lens_cpu)
        starts = (meta.prefix_lens.long() - (window - 1)).clamp(min=0)
    nq = meta.max_extend_len
    own_lens = [p + n - s for p, n, s in
                zip(meta.prefix_lens_cpu, meta.extend_lens_cpu, starts_cpu, strict=True)]
    own_len = max(own_lens)
    if (B == 1 and not meta.shared) or (B * nq * own_len > MAX_PADDED_ELEMENTS and B > 1):
        return None
    j = torch.arange(nq, device=dev)
    q_valid = j[None, :] < meta.extend_lens[:, None]  # (B, Nq)
    padded = any(n != nq for n in meta.extend_lens_cpu)
    q_rows = out_rows = None
    if padded:
        q_rows = torch.where(q_valid, meta.cu_extend[:-1, None] + j[None, :], 0).flatten()
        out_rows = q_valid.flatten().nonzero().squeeze(1)  # (T,)
    k_pos = starts[:, None] + torch.arange(own_len, device=dev)  # (B, Lo)
    mask = None
    if nq > 1 or any(n != own_len for n in own_lens):
        q_pos = meta.prefix_lens[:, None] + j[None, :]  # (B, Nq) absolute positions
        keep = k_pos[:, None, :] <= q_pos[:, :, None]  # (B, Nq, Lo): causal; also < seq_len
        if window is not None:
            keep &= k_pos[:, None, :] > q_pos[:, :, None] - window
        keep |= ~q_valid[:, :, None]  # padded queries attend to everything (output dropped)
        keep = keep[:, None, :, None, :].expand(B, 1, nq, group_size, own_len)
        zero = torch.zeros((), dtype=dtype, device=dev)
        mask = torch.where(keep, zero, float("-inf")).reshape(B, 1, nq * group_size, own_len)
    k_pos = k_pos.clamp(max=meta.slot_table.shape[1] - 1)
    own_slots = meta.slot_table[meta.rows[:, None], k_pos].flatten()  # (B * Lo,) int32
    return CascadePlan(B, nq, own_len, q_rows, out_rows, own_slots, mask, plan_groups(meta))


@dataclass
class DecodePlan:
    """Decode tokens and short chunks for the native kernel (one row per new token): keys
    read in place through the slot table."""

    slot_table: torch.Tensor  # (R, Lmax) int32
    rows: torch.Tensor  # (T,) int64: each new token's table row
    starts: torch.Tensor  # (T,) int64: first position of its request's own part
    seq_lens: torch.Tensor  # (T,) int64: its position + 1 (the end of its causal range)
    groups: list[Group]


def make_decode_plan(meta: AttentionMetadata, window: int | None) -> DecodePlan:
    """One kernel row per new token: token j of request b is at position prefix_b + j and
    attends to [own_start_b, prefix_b + j + 1), which is causal attention (the forward stored
    every new token's K/V in the pool before attending). The groups' prefixes end at or before
    prefix_b (tree pages are computed), so every token sees all of its group's. A decode step
    is the case of one token per request (built once per forward, not per layer). A window
    (meta without groups) raises each token's start to its position + 1 - window."""
    starts = meta.own_start if meta.own_start is not None else torch.zeros_like(meta.rows)
    T = sum(meta.extend_lens_cpu)
    if T == meta.batch_size:  # a decode step, one token each: the per-request rows as they are
        ends = meta.seq_lens.long()  # (B,) its position + 1
        if window is not None:
            starts = torch.maximum(starts.long(), (ends - window).clamp(min=0))
        return DecodePlan(meta.slot_table, meta.rows.long(), starts.long(), ends,
                           plan_groups(meta))
    ext = meta.extend_lens.long()

    def per_token(x: torch.Tensor) -> torch.Tensor:  # (B,) -> (T,)
        return torch.repeat_interleave(x.long(), ext, output_size=T)

    j = torch.arange(T, device=ext.device) - per_token(meta.cu_extend[:-1])  # (T,)
    ends = per_token(meta.prefix_lens) + j + 1
    token_starts = per_token(starts)
    if window is not None:
        token_starts = torch.maximum(token_starts, (ends - window).clamp(min=0))
    return DecodePlan(meta.slot_table, per_token(meta.rows), token_starts, ends, plan_groups(meta))


def plan_groups(meta: AttentionMetadata) -> list[Group]:
    """The forward's shared groups: each one's query rows (None: every token) and prefix slots."""
    groups = []
    cu = token_offsets(meta.extend_lens_cpu)
    for g in meta.shared:
        members = g.members_cpu or tuple(g.members.tolist())
        token_rows = None
        if len(members) < meta.batch_size:
            rows = [r for b in members for r in range(cu[b], cu[b + 1])]
            token_rows = torch.tensor(rows, dtype=torch.int64, device=meta.rows.device)
        # A prefix computed in one prefill usually got consecutive slots from the allocator;
        # the runner tells (host side), so planning needs no device sync.
        groups.append(Group(token_rows, g.slots, g.first_slot))
    return groups
