"""Reference attention backend in plain torch (CPU and CUDA), cascading over shared prefixes.

Cascade attention: the keys of a tree prefix that several requests share are attended once.

Owns: storing new K/V into the pool and attention through the slot table (`attend`: the
same without the store, where the model stored them itself: norm_rope's rope_store on CPU).
Each request's keys are split in two parts, merged by log-sum-exp:
- the group part: a tree prefix shared by a group of requests (meta.shared), attended once
  for all the group's query tokens (one gather, one kernel) instead of once per request;
- the own part: positions [own_start, seq_len), gathered into one padded block for the whole
  batch and masked (causal inside the request's new tokens, and the padding).
Long prefill chunks (MIN_VARLEN_TOKENS tokens or more) go to attention/varlen.py, one
request at a time on this forward's own k/v; the cascade above takes the rest of the batch
(decode tokens and short prefill chunks, e.g. the decodes of a mixed step). A rest whose padded
block would be too large, or a lone request with no group, goes to one SDPA call per request
(per_request.py).
On CPU, a rest of decode tokens and short chunks (at most SHORT_QUERY_MAX new tokens each:
drafts to verify) goes instead to the native paged kernel (cpu_kernels.py) when the backend
was given it: one kernel row per new token, its own causal range read in place, then the groups
merged as above;
long prefill chunks likewise go to the native causal prefill kernel when given (varlen.py).
The split and the plan (indices, mask; cascade_plan.py) are built once per forward and reused by every layer
(one plan per sliding window the forward's layers use).
A sliding window (attention/base.py) skips the shared groups (a window may end inside a shared
prefix) and starts each request's own part at its first query's window; the masks and the native
kernels bound each query's keys. A soft-cap is applied to every partial's scores (the torch
partials then run as matmul + logsumexp; the native kernels cap in place).
An 8-bit pool (--kv-cache-dtype fp8*; the layer's scales passed with each call) is stored
quantized (kv_quant.store), read in place by the native decode and prefill kernels, and
dequantized by every torch path as it gathers (kv_read.KVReader).
Does not know: the model, the scheduler.

On CPU every partial attention is one call of torch's fused flash kernel, which also returns
the log-sum-exp the merge needs: no (queries x keys) score tensor is written to memory, which
made the previous matmul/softmax path much slower on long prefills. Elsewhere the same
partials run as matmul + logsumexp.

Query heads sharing a KV head (GQA groups of G) are folded into the query length:
(tokens, Hkv, G, D) -> (Hkv, tokens * G, D), so K/V are never repeated.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from radixserve.attention.base import AttentionMetadata, check_window_softcap
from radixserve.attention.cascade_plan import (
    CascadePlan,
    DecodePlan,
    Group,
    make_decode_plan,
    make_plan,
)
from radixserve.attention.cpu_kernels import PagedDecode, PrefillAttention, cap_scores
from radixserve.attention.kv_quant import KVScale, store
from radixserve.attention.kv_read import KVReader, Scratch
from radixserve.attention.per_request import attend_per_request
from radixserve.attention.varlen import (
    Split,
    attend_long,
    merge_outputs,
    split_batch,
)

# Up to this many new tokens per request the paged decode kernel runs one row per token
# (each reads its request's keys again) rather than the cascade gathering a padded copy of
# every request's keys per layer and masking it. One layer, 32 requests x 550-token context,
# 2 cores, bf16 (fp32 alike): 2 new tokens each 1.5 vs 4.2 ms, 4: 3.0 vs 5.3, 8: 5.4 vs 6.5,
# 16: 10.5 vs 11.4 (the gap closes as the kernel's rereads grow).
SHORT_QUERY_MAX = 8


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
            mask: torch.Tensor | None, scale: float, softcap: float | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention over part of the keys, with its log-sum-exp for merging.

    q: (B, H, M, D); keys/values: (B, H, L, D), any strides with D contiguous; mask: additive,
    q's dtype, broadcastable to (B, H, M, L), or None; softcap: scores soft-capped first.
    Returns out (B, H, M, D) in q's dtype and lse (B, H, M) float32.
    """
    if q.device.type == "cpu" and softcap is None:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, keys, values, attn_mask=mask, scale=scale)
        return out, lse
    return _attend_math(q, keys, values, mask, scale, softcap)


def _attend_math(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                 mask: torch.Tensor | None, scale: float, softcap: float | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.matmul(q, keys.transpose(-1, -2)).float() * scale  # (B, H, M, L)
    scores = cap_scores(scores, softcap)
    if mask is not None:
        scores = scores + mask
    lse = torch.logsumexp(scores, dim=-1)  # (B, H, M)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return torch.matmul(probs.to(values.dtype), values), lse


@dataclass(frozen=True)
class _Limits:
    """One call's per-layer options (attention/base.py)."""

    window: int | None
    softcap: float | None


class TorchAttentionBackend:
    """paged_decode: the native CPU kernel (cpu_kernels.load_paged_decode()) for decode tokens
    and short chunks (drafts to verify); prefill: cpu_kernels.load_prefill_attention() for
    long prefill chunks (varlen.py); None for the torch path there (the reference)."""

    reads_shared_prefixes = True  # a group's shared prefix is attended once (_merge_group)
    fused_kernels = False  # attend() serves the CPU loop's native RoPE + store only

    def __init__(self, paged_decode: PagedDecode | None = None,
                 prefill: PrefillAttention | None = None) -> None:
        # NOTE: the plan of the current forward, keyed by its metadata object; every layer of
        # one forward receives the same `meta`.
        self._plan_meta: AttentionMetadata | None = None
        self._split: Split | None = None
        # of the short requests (split.short_meta), per sliding window (None: causal)
        self._plans: dict[int | None, CascadePlan | DecodePlan | None] = {}
        self.scratch = Scratch()
        self.paged_decode = paged_decode
        self.prefill = prefill

    def _plan_short(self, meta: AttentionMetadata, q: torch.Tensor, kv_heads: torch.Tensor,
                    window: int | None) -> CascadePlan | DecodePlan | None:
        """kv_heads: this forward's k (T, Hkv, D) or the pool's (S, Hkv, D)."""
        # Decode tokens and short chunks through the kernel: it reads each request's keys in
        # place, where the cascade gathers them into a padded block per layer first (a copy
        # as large as the keys) and then runs flash over it.
        if window is not None:  # a window may end inside a shared prefix: no groups
            meta = dataclasses.replace(meta, shared=(), own_start=None, own_start_cpu=())
        if (self.paged_decode is not None and meta.max_extend_len <= SHORT_QUERY_MAX
                and q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)):
            return make_decode_plan(meta, window)
        return make_plan(meta, q.shape[1] // kv_heads.shape[1], q.dtype, window)

    def forward(
        self,
        q: torch.Tensor,  # (T, Hq, D)
        k: torch.Tensor,  # (T, Hkv, D)
        v: torch.Tensor,  # (T, Hkv, D)
        k_cache: torch.Tensor,  # (S, Hkv, D)
        v_cache: torch.Tensor,  # (S, Hkv, D)
        meta: AttentionMetadata,
        scale: float,
        kv_scale: KVScale | None = None,
        *,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        check_window_softcap(window, softcap)
        kscale, vscale = (None, None) if kv_scale is None else kv_scale
        store(k_cache, meta.out_slots, k, kscale)
        store(v_cache, meta.out_slots, v, vscale)
        return self._attend(q, (k, v), k_cache, v_cache, meta, scale, kv_scale, window, softcap)

    def attend(
        self,
        q: torch.Tensor,  # (T, Hq, D), any token stride
        k_cache: torch.Tensor,  # (S, Hkv, D), this forward's K/V already stored
        v_cache: torch.Tensor,  # (S, Hkv, D)
        meta: AttentionMetadata,
        scale: float,
        kv_scale: KVScale | None = None,
        *,
        window: int | None = None,
        softcap: float | None = None,
        check: bool = True,
    ) -> torch.Tensor:
        """forward() without the store: the model stored this forward's K/V itself
        (norm_rope's rope_store). Long prefill chunks read theirs back from the pool (an
        8-bit pool's then dequantized: forward() keeps such a chunk's own K/V exact)."""
        if check:
            check_window_softcap(window, softcap)
        return self._attend(q, None, k_cache, v_cache, meta, scale, kv_scale, window, softcap)

    def _attend(self, q: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor] | None,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                scale: float, kv_scale: KVScale | None, window: int | None,
                softcap: float | None) -> torch.Tensor:
        """kv: this forward's K/V (T, Hkv, D) each, or None: read from the pool if needed."""
        if meta is not self._plan_meta:
            self._plan_meta, self._split, self._plans = meta, split_batch(meta), {}
        split = self._split
        assert split is not None
        if split.short_meta is not None and window not in self._plans:
            self._plans[window] = self._plan_short(split.short_meta, q, k_cache, window)
        if not split.long:
            plan = self._plans[window]
            if type(plan) is DecodePlan and not plan.groups:  # a decode step: one call
                return self._paged(q, k_cache, v_cache, plan, scale, kv_scale, softcap)[0]
        reader = KVReader(self.scratch, kv_scale, q.dtype)
        lim = _Limits(window, softcap)
        if not split.long:
            return self._short(q, k_cache, v_cache, meta, scale, reader, lim)
        # Long prefill chunks one by one; decode tokens and short prefill chunks of the
        # same batch (a mixed step) through the cascade, on their own rows of q.
        if kv is None:  # copies, not the reader's reused buffers (the prefix gathers use them)
            kv = (reader.gather(k_cache, meta.out_slots, "k").clone(),
                  reader.gather(v_cache, meta.out_slots, "v").clone())
        k, v = kv
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if split.short_meta is not None:
            assert split.short_rows is not None
            short = self._short(q.index_select(0, split.short_rows), k_cache, v_cache,
                                split.short_meta, scale, reader, lim)
            out.index_copy_(0, split.short_rows, short)
        attend_long(q, k, v, k_cache, v_cache, meta, split.long, out, scale, reader.gather,
                    self.prefill, kv_scale, window, softcap)
        return out

    def _short(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, scale: float, reader: KVReader, lim: _Limits
               ) -> torch.Tensor:
        plan = self._plans[lim.window]
        if plan is None:
            return attend_per_request(q, k_cache, v_cache, meta, scale, reader, lim.window,
                                      lim.softcap)
        if isinstance(plan, DecodePlan):
            return self._decode_native(q, k_cache, v_cache, plan, scale, reader, lim.softcap)
        return self._cascade(q, k_cache, v_cache, plan, scale, reader, lim.softcap)

    def _paged(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               plan: DecodePlan, scale: float, kv_scale: KVScale | None,
               softcap: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The native kernel over each token's own part: out (T, Hq, D), lse (T, Hq)."""
        assert self.paged_decode is not None
        kscale, vscale = (None, None) if kv_scale is None else kv_scale
        return self.paged_decode(q, k_cache, v_cache, plan.slot_table, plan.rows, plan.starts,
                                 plan.seq_lens, scale, kscale, vscale,
                                 0.0 if softcap is None else softcap)

    def _decode_native(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       plan: DecodePlan, scale: float, reader: KVReader,
                       softcap: float | None) -> torch.Tensor:
        """Each request's own part by the native kernel, then its shared group merged in."""
        T, Hq, D = q.shape  # one kernel row per new token
        Hkv = k_cache.shape[1]
        out, lse = self._paged(q, k_cache, v_cache, plan, scale, reader.kv_scale, softcap)
        if not plan.groups:
            return out
        out, lse = out.view(T, Hkv, Hq // Hkv, D), lse.view(T, Hkv, Hq // Hkv)
        for g in plan.groups:  # disjoint: each token is merged at most once
            out = self._merge_group(q, k_cache, v_cache, g, out, lse, scale, reader, softcap)
        return out.reshape(T, Hq, D)

    def _cascade(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 plan: CascadePlan, scale: float, reader: KVReader, softcap: float | None
                 ) -> torch.Tensor:
        T, Hq, D = q.shape
        Hkv = k_cache.shape[1]
        G = Hq // Hkv
        B, Nq, Lo = plan.num_reqs, plan.max_new, plan.own_len
        qp = q if plan.q_rows is None else q.index_select(0, plan.q_rows)  # (B * Nq, Hq, D)
        qp = qp.reshape(B, Nq, Hkv, G, D).transpose(1, 2).reshape(B, Hkv, Nq * G, D)
        keys = reader.gather(k_cache, plan.own_slots, "k").view(B, Lo, Hkv, D).transpose(1, 2)
        values = reader.gather(v_cache, plan.own_slots, "v").view(B, Lo, Hkv, D).transpose(1, 2)
        out, lse = _attend(qp, keys, values, plan.mask, scale,
                           softcap)  # (B, Hkv, Nq * G, D), (B, Hkv, Nq * G)
        out = out.reshape(B, Hkv, Nq, G, D).transpose(1, 2).reshape(B * Nq, Hkv, G, D)
        lse = lse.reshape(B, Hkv, Nq, G).transpose(1, 2).reshape(B * Nq, Hkv, G)
        if plan.out_rows is not None:
            out, lse = out.index_select(0, plan.out_rows), lse.index_select(0, plan.out_rows)
        for g in plan.groups:  # disjoint: each token is merged at most once
            out = self._merge_group(q, k_cache, v_cache, g, out, lse, scale, reader, softcap)
        return out.reshape(T, Hq, D)

    @staticmethod
    def _merge_group(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, g: Group,
                     out: torch.Tensor, lse: torch.Tensor, scale: float, reader: KVReader,
                     softcap: float | None) -> torch.Tensor:
        """Attend the group's tokens to its shared prefix and merge into `out` (T, Hkv, G, D)
        by log-sum-exp: o = o_prefix + sigmoid(lse_own - lse_prefix) * (o_own - o_prefix)."""
        _, Hkv, G, D = out.shape
        gq = q if g.token_rows is None else q.index_select(0, g.token_rows)  # (N, Hq, D)
        N = gq.shape[0]
        gq = gq.reshape(N, Hkv, G, D).transpose(0, 1).reshape(1, Hkv, N * G, D)
        gk = g.keys(k_cache, reader, "k").transpose(0, 1).unsqueeze(0)  # (1, Hkv, S, D)
        gv = g.keys(v_cache, reader, "v").transpose(0, 1).unsqueeze(0)
        o2, lse2 = _attend(gq, gk, gv, None, scale, softcap)  # (1,Hkv,N*G,D), (1,Hkv,N*G)
        o2 = o2.reshape(Hkv, N, G, D).transpose(0, 1)  # (N, Hkv, G, D)
        lse2 = lse2.reshape(Hkv, N, G).transpose(0, 1)  # (N, Hkv, G)
        o1, lse1 = out, lse
        if g.token_rows is not None:
            o1, lse1 = out.index_select(0, g.token_rows), lse.index_select(0, g.token_rows)
        merged = merge_outputs(o2, lse2, o1, lse1)  # (N, Hkv, G, D)
        if g.token_rows is None:
            return merged
        return out.index_copy(0, g.token_rows, merged)
