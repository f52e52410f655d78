"""Attention for long prefill chunks, request by request, without padding or masks.

Owns: splitting a batch into its long prefill chunks (handled here) and the rest (decode tokens and
short prefill chunks, for the padded cascade of torch_backend), and the attention of one long prefill chunk:
- its new tokens attend to themselves causally, read straight from this forward's k/v (the
  pool holds the same values; gathering them back would only copy), in query chunks: each
  chunk one fused flash call with is_causal on itself, one without a mask on the tokens
  before it; no (queries x keys) mask or score tensor is written to memory;
- its cached prefix (a tree match or earlier chunks), when there is one, is gathered from
  the pool once per layer and attended without a mask (every prefix key precedes every new
  token), then merged with the causal part by log-sum-exp.
On CPU with the native kernel (cpu_kernels.load_prefill_attention(): fp32/bf16, head_dim 32,
64 or 128), each prefill chunk is instead one call of csrc/prefill_attention.cpp: the prefix read in
place through the slot table (an 8-bit pool's rows converted as the kernel reads them), the
chunk causal on itself, masked key blocks skipped; the
torch path above stays as the fallback and the tests' reference.
Does not know: the model, the scheduler, how the pool is laid out beyond the slot table.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from radixserve.attention.base import AttentionMetadata, SharedPrefix, window_start
from radixserve.attention.cpu_kernels import PREFILL_HEAD_DIMS, PrefillAttention, cap_scores
from radixserve.attention.kv_quant import KVScale

# A prefill chunk this long is attended on its own: padding it into a block with the others
# would cost up to (longest / its length) times the work, and its causal mask as much memory.
MIN_VARLEN_TOKENS = 64
# torch's CPU flash kernel computes a causal block's masked half too (its key blocks are 512
# long), and the exps dominate: a long prefill attended in query chunks (each causal on
# itself, unmasked on the tokens before it) takes less CPU than one causal call (figures:
# bench/README.md; chunks of 128 or 256 alike).
CAUSAL_CHUNK = 256



def token_offsets(extend_lens: Sequence[int]) -> list[int]:
    """cu[b]: request b's first token in a forward's q/k/v; cu[-1]: the forward's tokens."""
    return list(itertools.accumulate(extend_lens, initial=0))

@dataclass(frozen=True)
class Split:
    """Which requests of a batch go where; fixed for one forward."""

    long: tuple[int, ...]  # batch indices of the long prefill chunks (varlen path)
    short_meta: AttentionMetadata | None  # metadata of the other requests (cascade path)
    short_rows: torch.Tensor | None  # (Ts,) rows of q of those requests; None: all rows


def split_batch(meta: AttentionMetadata) -> Split:
    if meta.max_extend_len < MIN_VARLEN_TOKENS:  # no long chunk (every decode step): no scan
        return Split((), meta, None)
    long = tuple(b for b, n in enumerate(meta.extend_lens_cpu) if n >= MIN_VARLEN_TOKENS)
    if not long:
        return Split((), meta, None)
    short = [b for b in range(meta.batch_size) if b not in set(long)]
    if not short:
        return Split(long, None, None)
    return Split(long, subset_meta(meta, short), _token_rows(meta, short))


def _token_rows(meta: AttentionMetadata, members: list[int]) -> torch.Tensor:
    cu = token_offsets(meta.extend_lens_cpu)
    rows = [r for b in members for r in range(cu[b], cu[b + 1])]
    return torch.tensor(rows, dtype=torch.int64, device=meta.rows.device)


def subset_meta(meta: AttentionMetadata, members: list[int]) -> AttentionMetadata:
    """The metadata of some requests of the batch, as if they were the whole batch."""
    dev = meta.rows.device
    idx = torch.tensor(members, dtype=torch.int64, device=dev)
    new_index = {b: i for i, b in enumerate(members)}
    extend = [meta.extend_lens_cpu[b] for b in members]
    prefix = [meta.prefix_lens_cpu[b] for b in members]
    cu = token_offsets(extend)
    shared = []
    own_start = [meta.own_start_cpu[b] if meta.own_start_cpu else 0 for b in members]
    for g in meta.shared:
        kept = [new_index[b] for b in g.members_cpu if b in new_index]
        if kept:
            shared.append(dataclasses.replace(
                g, members=torch.tensor(kept, dtype=torch.int64, device=dev),
                members_cpu=tuple(kept)))
    return dataclasses.replace(
        meta, rows=meta.rows.index_select(0, idx),
        prefix_lens=meta.prefix_lens.index_select(0, idx),
        extend_lens=meta.extend_lens.index_select(0, idx),
        seq_lens=meta.seq_lens.index_select(0, idx),
        cu_extend=torch.tensor(cu, dtype=torch.int32, device=dev),
        out_slots=meta.out_slots.new_empty(0),  # stored already; planning never reads it
        prefix_lens_cpu=tuple(prefix), extend_lens_cpu=tuple(extend),
        max_seq_len=max(p + n for p, n in zip(prefix, extend, strict=True)),
        max_extend_len=max(extend), rows_cpu=tuple(meta.rows_cpu[b] for b in members),
        shared=tuple[SharedPrefix, ...](shared),
        own_start=torch.tensor(own_start, dtype=torch.int64, device=dev),
        own_start_cpu=tuple(own_start))


def _flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """q (1, Hq, M, D), k/v (1, Hkv, L, D) with Hkv dividing Hq -> out (1, Hq, M, D), lse
    (1, Hq, M) float32. torch's CPU flash kernel takes grouped K/V heads as they are."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, is_causal=causal, scale=scale)
        return out, lse
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # (1, Hq, M, L)
    if causal:
        m, n = scores.shape[-2:]
        scores.masked_fill_(torch.ones(m, n, dtype=torch.bool, device=q.device).triu(1),
                            float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)).to(v.dtype), v), lse


Gather = Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor]  # (cache, slots, key)


def attend_positions(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     q_pos: torch.Tensor, k_pos: torch.Tensor, scale: float,
                     window: int | None, softcap: float | None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention by positions, with the per-call options (attention/base.py): query at q_pos
    sees the keys at k_pos <= q_pos (and > q_pos - window), scores soft-capped. q (M, Hq, D),
    keys/values (L, Hkv, D), q_pos (M,), k_pos (L,) -> out (M, Hq, D), lse (M, Hq) float32.
    Every query must see at least one key (its own position is among k_pos).

    GQA groups are folded into the query length: (M, Hkv, G, D) -> (1, Hkv, M * G, D)."""
    M, Hq, D = q.shape
    Hkv = keys.shape[1]
    G = Hq // Hkv
    qf = q.reshape(M, Hkv, G, D).transpose(0, 1).reshape(1, Hkv, M * G, D)
    kf, vf = keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0)
    keep = k_pos[None, :] <= q_pos[:, None]  # (M, L)
    if window is not None:
        keep &= k_pos[None, :] > q_pos[:, None] - window
    keep = keep.repeat_interleave(G, dim=0)  # (M * G, L), rows as qf's
    if softcap is None and q.device.type == "cpu":
        mask = torch.zeros(keep.shape, dtype=q.dtype, device=q.device).masked_fill_(
            ~keep, float("-inf"))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            qf, kf, vf, attn_mask=mask, scale=scale)
    else:
        scores = cap_scores(torch.matmul(qf, kf.transpose(-1, -2)).float() * scale, softcap)
        scores = scores.masked_fill(~keep, float("-inf"))  # (1, Hkv, M * G, L)
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)).to(vf.dtype), vf)
    out = out.reshape(Hkv, M, G, D).transpose(0, 1).reshape(M, Hq, D)
    return out, lse.reshape(Hkv, M, G).transpose(0, 1).reshape(M, Hq)


def merge_outputs(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
                  ) -> torch.Tensor:
    """Two partial attentions of the same queries over disjoint keys, merged by log-sum-exp:
    o = o1 + sigmoid(lse2 - lse1) * (o2 - o1), each part weighted by its softmax mass.
    o: (..., n, D) in the attention dtype, lse: (..., n) float32; the result in o1's dtype."""
    weight = torch.sigmoid(lse2 - lse1).unsqueeze(-1)  # (..., n, 1) float32
    return torch.lerp(o1.float(), o2.float(), weight).to(o1.dtype)


def merge_partials(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """merge_outputs, and the merged log-sum-exp (for a further merge)."""
    return merge_outputs(o1, lse1, o2, lse2), torch.logaddexp(lse1, lse2)


def _chunks(n: int) -> list[tuple[int, int]]:
    """[0, n) in near-equal query chunks of at most CAUSAL_CHUNK tokens."""
    count = -(-n // CAUSAL_CHUNK)
    bounds = [n * i // count for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def attend_long(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, long: tuple[int, ...],
                out: torch.Tensor, scale: float, gather: Gather,
                kernel: PrefillAttention | None = None, kv_scale: KVScale | None = None,
                window: int | None = None, softcap: float | None = None) -> None:
    """Write into out (T, Hq, D) the attention of the long prefill chunks' tokens.

    q (T, Hq, D), k/v (T, Hkv, D): this forward's tokens, already stored in the pool.
    gather(cache, slots, key) reads cached prefix K/V (S, Hkv, D) in q's dtype (dequantized from
    an 8-bit pool), consumed before the next; kv_scale: the layer's scales of an 8-bit pool.
    Queries go in chunks of <= CAUSAL_CHUNK tokens: a chunk attends causally to itself and
    without a mask to this forward's earlier tokens (views of k/v) and to the cached prefix,
    the parts merged by log-sum-exp. With `kernel` (cpu_kernels.load_prefill_attention()),
    each prefill chunk is one call instead: the prefix read in place, causal blocks skipped.
    window / softcap (attention/base.py): only the prefix inside the first query's window is
    read; the torch path then attends each query chunk by positions (attend_positions).
    """
    if kernel is not None and kernel_applies(q, k, v):
        _attend_long_native(q, k, v, k_cache, v_cache, meta, long, out, scale, kernel, kv_scale,
                            window, softcap)
        return
    if window is not None or softcap is not None:
        _attend_long_limited(q, k, v, k_cache, v_cache, meta, long, out, scale, gather, window,
                             softcap)
        return
    cu = token_offsets(meta.extend_lens_cpu)

    def heads(x: torch.Tensor) -> torch.Tensor:  # (n, H, D) -> (1, H, n, D), a view
        return x.transpose(0, 1).unsqueeze(0)

    for b in long:
        s, e = cu[b], cu[b + 1]
        prefix = meta.prefix_lens_cpu[b]
        kp = vp = None
        if prefix:
            slots = meta.slot_table[meta.rows_cpu[b], :prefix]
            kp = heads(gather(k_cache, slots, "k"))  # (1, Hkv, P, D)
            vp = heads(gather(v_cache, slots, "v"))
        for c0, c1 in _chunks(e - s):
            qc = heads(q[s + c0 : s + c1])  # (1, Hq, c, D)
            o, lse = _flash(qc, heads(k[s + c0 : s + c1]), heads(v[s + c0 : s + c1]), True, scale)
            if c0:  # this forward's tokens before the chunk: all visible
                o, lse = merge_partials(o, lse, *_flash(qc, heads(k[s : s + c0]), heads(v[s : s + c0]),
                                                False, scale))
            if kp is not None and vp is not None:
                o, lse = merge_partials(o, lse, *_flash(qc, kp, vp, False, scale))
            out[s + c0 : s + c1] = o[0].transpose(0, 1)


def _attend_long_limited(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                         long: tuple[int, ...], out: torch.Tensor, scale: float, gather: Gather,
                         window: int | None, softcap: float | None) -> None:
    """attend_long with a window or a soft-cap, in torch: per query chunk, one attention by
    positions over the keys its window reaches (the prefix's from the pool, this forward's
    as views of k/v)."""
    cu = token_offsets(meta.extend_lens_cpu)
    dev = q.device
    for b in long:
        s, e = cu[b], cu[b + 1]
        prefix = meta.prefix_lens_cpu[b]
        lo = window_start(prefix, window)
        slots = meta.slot_table[meta.rows_cpu[b], lo:prefix]
        kp, vp = gather(k_cache, slots, "k"), gather(v_cache, slots, "v")  # (P', Hkv, D)
        for c0, c1 in _chunks(e - s):
            first = window_start(prefix + c0, window)  # the chunk's first visible key
            keys = [kp[first - lo :]] if first < prefix else []
            values = [vp[first - lo :]] if first < prefix else []
            n0 = max(first - prefix, 0)  # this forward's tokens from n0 on
            keys.append(k[s + n0 : s + c1])
            values.append(v[s + n0 : s + c1])
            k_pos = torch.arange(first, prefix + c1, device=dev)
            q_pos = torch.arange(prefix + c0, prefix + c1, device=dev)
            o, _ = attend_positions(q[s + c0 : s + c1], torch.cat(keys), torch.cat(values),
                                    q_pos, k_pos, scale, window, softcap)
            out[s + c0 : s + c1] = o


def kernel_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the native prefill kernel takes these tensors (else the torch path)."""
    return (q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16)
            and q.shape[-1] in PREFILL_HEAD_DIMS
            and q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1)


def _attend_long_native(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                        long: tuple[int, ...], out: torch.Tensor, scale: float,
                        kernel: PrefillAttention, kv_scale: KVScale | None,
                        window: int | None, softcap: float | None) -> None:
    """attend_long through the native kernel: one call per prefill chunk, its whole chunk causal on
    itself and unmasked on its prefix (slots read from the pool, no gather; an 8-bit pool's rows
    converted with kv_scale by the kernel as it reads them). With a window, only the prefix
    slots the chunk's first query sees are passed, and the kernel bounds each query's keys."""
    cu = token_offsets(meta.extend_lens_cpu)
    scales = () if kv_scale is None else tuple(kv_scale)
    options: dict[str, float | int] = {}  # the kernel's defaults (0: none) where not set
    if softcap is not None:
        options["softcap"] = softcap
    if window is not None:
        options["window"] = window
    for b in long:
        s, e = cu[b], cu[b + 1]
        prefix = meta.prefix_lens_cpu[b]
        lo = window_start(prefix, window)
        slots = meta.slot_table[meta.rows_cpu[b], lo:prefix]  # (P,) int32
        o, _ = kernel(q[s:e], k[s:e], v[s:e], k_cache, v_cache, slots, scale, *scales, **options)
        out[s:e] = o
