"""Plain-torch versions of every kernel, with the same signatures and semantics.

Owns: the ground truth the kernel tests and bench compare against (and a slow fallback).
Attention computes in fp32 whatever the input dtype; the elementwise ops (norm, RoPE, SiLU)
round op by op in the input dtype as torch and HF do. Loops over requests on the host;
clarity over speed. An 8-bit cache (float8_e4m3fn / float8_e5m2) comes with k_scale, v_scale
(kv_heads,): stored = x / scale saturated to the format's range, read = stored * scale.
Does not know: Triton.
"""

from __future__ import annotations

import torch


def store_kv_ref(
    k_cache: torch.Tensor,  # (num_slots, kv_heads, head_dim)
    v_cache: torch.Tensor,  # (num_slots, kv_heads, head_dim)
    k: torch.Tensor,  # (T, kv_heads, head_dim)
    v: torch.Tensor,  # (T, kv_heads, head_dim)
    slots: torch.Tensor,  # (T,)
    k_scale: torch.Tensor | None = None,  # (kv_heads,) float32
    v_scale: torch.Tensor | None = None,
) -> None:
    for cache, x, s in ((k_cache, k, k_scale), (v_cache, v, v_scale)):
        if s is not None:
            limit = torch.finfo(cache.dtype).max
            x = (x.float() / s[None, :, None]).clamp(-limit, limit)
        # float8 has no index_put on CPU: the bytes are written
        cache.view(torch.uint8)[slots.long()] = x.to(cache.dtype).view(torch.uint8)


def read_kv_ref(cache: torch.Tensor, slots: torch.Tensor, scale: torch.Tensor | None
                ) -> torch.Tensor:  # (L, kv_heads, head_dim) fp32
    """cache[slots] in fp32, dequantized with `scale` (kv_heads,) when the cache is 8-bit."""
    rows = cache[slots.long()].float()
    return rows if scale is None else rows * scale[None, :, None]


def attend_ref(
    q: torch.Tensor,  # (n, q_heads, head_dim)
    keys: torch.Tensor,  # (L, kv_heads, head_dim)
    values: torch.Tensor,  # (L, kv_heads, head_dim)
    visible: torch.Tensor,  # (n, L) bool: which keys each query sees
    scale: float,
    softcap: float | None = None,  # scaled scores s -> softcap * tanh(s / softcap)
) -> torch.Tensor:  # (n, q_heads, head_dim) fp32
    group = q.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group, dim=1)  # (L, q_heads, D)
    values = values.float().repeat_interleave(group, dim=1)  # (L, q_heads, D)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), keys) * scale  # (q_heads, n, L)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(dim=-1), values)


def decode_attention_ref(
    q: torch.Tensor,  # (B, q_heads, head_dim)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_table: torch.Tensor,  # (max_reqs, max_model_len)
    rows: torch.Tensor,  # (B,)
    seq_lens: torch.Tensor,  # (B,)
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,  # the last `window` positions only
    softcap: float | None = None,
) -> torch.Tensor:  # (B, q_heads, head_dim)
    out = torch.empty_like(q)
    for b, (row, seq_len) in enumerate(zip(rows.tolist(), seq_lens.tolist(), strict=True)):
        slots = slot_table[row, :seq_len].long()
        visible = torch.ones(1, seq_len, dtype=torch.bool, device=q.device)
        if window is not None:
            visible[:, : max(0, seq_len - window)] = False
        out[b] = attend_ref(q[b : b + 1], read_kv_ref(k_cache, slots, k_scale),
                            read_kv_ref(v_cache, slots, v_scale), visible, scale, softcap)[0]
    return out


def extend_attention_ref(
    q: torch.Tensor,  # (T, q_heads, head_dim)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_table: torch.Tensor,
    rows: torch.Tensor,  # (B,)
    prefix_lens: torch.Tensor,  # (B,)
    extend_lens: torch.Tensor,  # (B,)
    cu_extend: torch.Tensor,  # (B + 1,)
    scale: float,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    window: int | None = None,  # token at p sees positions p - window + 1 .. p only
    softcap: float | None = None,
) -> torch.Tensor:  # (T, q_heads, head_dim)
    out = torch.empty_like(q)
    starts = cu_extend.tolist()
    triples = zip(rows.tolist(), prefix_lens.tolist(), extend_lens.tolist(), strict=True)
    for b, (row, prefix, n) in enumerate(triples):
        slots = slot_table[row, : prefix + n].long()
        q_pos = torch.arange(prefix, prefix + n, device=q.device)
        k_pos = torch.arange(prefix + n, device=q.device)
        visible = k_pos[None, :] <= q_pos[:, None]  # (n, prefix + n)
        if window is not None:
            visible &= k_pos[None, :] > q_pos[:, None] - window
        qb = q[starts[b] : starts[b] + n]
        out[starts[b] : starts[b] + n] = attend_ref(
            qb, read_kv_ref(k_cache, slots, k_scale), read_kv_ref(v_cache, slots, v_scale),
            visible, scale, softcap)
    return out


def fused_add_rmsnorm_ref(
    x: torch.Tensor,  # (T, hidden); overwritten with the normalized rows
    residual: torch.Tensor | None,  # (T, hidden); overwritten with x + residual
    weight: torch.Tensor,  # (hidden,)
    eps: float,
) -> torch.Tensor:  # x
    """HF's LlamaRMSNorm after the residual add (none when residual is None), in place."""
    dtype = x.dtype
    if residual is not None:
        residual.copy_(x + residual)  # rounds to the dtype once, as the decoder layer does
    src = (x if residual is None else residual).float()
    normed = src * torch.rsqrt(src.pow(2).mean(-1, keepdim=True) + eps)
    x.copy_((normed.to(dtype).float() * weight.float()).to(dtype))
    return x


def rope_qk_store_ref(
    qkv: torch.Tensor,  # (T, W): q heads, k heads, v heads, head_dim columns each
    cos: torch.Tensor,  # (max_positions, head_dim)
    sin: torch.Tensor,  # (max_positions, head_dim), first half negated
    positions: torch.Tensor,  # (T,)
    num_q_heads: int,
    num_kv_heads: int,
    caches: tuple[torch.Tensor, torch.Tensor] | None,  # (k_cache, v_cache)
    slots: torch.Tensor | None,  # (T,)
    k_scale: torch.Tensor | None = None,  # (kv_heads,) float32: an 8-bit cache's scales
    v_scale: torch.Tensor | None = None,
) -> None:
    """rope_qk (caches None: q and k rotated in place) or rope_qk_store (q rotated in place,
    rotated k and v written to the caches at `slots` as store_kv_ref writes them, qkv's k left
    as it was)."""
    d = cos.shape[1]
    t = qkv.shape[0]
    heads = num_q_heads + num_kv_heads
    x = qkv[:, : heads * d].view(t, heads, d)
    c, s = cos[positions.long()].unsqueeze(1), sin[positions.long()].unsqueeze(1)  # (T, 1, D)
    rotated = x * c + torch.roll(x, d // 2, dims=-1) * s  # (T, heads, D), rounds per op
    if caches is None:
        x.copy_(rotated)
        return
    assert slots is not None
    x[:, :num_q_heads] = rotated[:, :num_q_heads]
    v = qkv[:, heads * d : (heads + num_kv_heads) * d].view(t, num_kv_heads, d)
    store_kv_ref(caches[0], caches[1], rotated[:, num_q_heads:], v, slots, k_scale, v_scale)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:  # (T, 2 * inter) -> (T, inter)
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def fused_moe_ref(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  gate_up: torch.Tensor, down: torch.Tensor, first_expert: int = 0
                  ) -> torch.Tensor:  # (T, hidden)
    """fused_moe pair by pair: each (token, expert) pair through its expert's weights
    (gathered per pair), weighted, pairs of experts not held here zero, summed per token."""
    num_tokens, top_k = topk_ids.shape
    num_local, inter = gate_up.shape[0], gate_up.shape[1] // 2
    local = topk_ids.reshape(-1) - first_expert  # (P,)
    held = (local >= 0) & (local < num_local)
    e = local.clamp(0, num_local - 1)
    rows = x.repeat_interleave(top_k, dim=0).unsqueeze(-1)  # (P, hidden, 1)
    gu = torch.bmm(gate_up[e], rows).squeeze(-1)  # (P, 2F)
    act = torch.nn.functional.silu(gu[:, :inter]) * gu[:, inter:]  # (P, F)
    y = torch.bmm(down[e], act.unsqueeze(-1)).squeeze(-1)  # (P, hidden)
    y = y * topk_weights.reshape(-1, 1).to(x.dtype)
    y = torch.where(held.unsqueeze(1), y, torch.zeros_like(y))
    return y.view(num_tokens, top_k, -1).sum(dim=1)


def lora_ref(x: torch.Tensor, a_stack: torch.Tensor, b_stack: torch.Tensor, y: torch.Tensor,
             token_slot: torch.Tensor) -> torch.Tensor:
    """y + (x @ A[slot].T) @ B[slot].T per token (slot -1: y unchanged), in fp32, rounded to
    y's dtype once: what lora_shrink followed by lora_expand compute. x: (T, K),
    a_stack: (S, R, K), b_stack: (S, N, R), y: (T, N), token_slot: (T,)."""
    out = y.clone()
    for tok, slot in enumerate(token_slot.tolist()):
        if slot < 0:
            continue
        t = x[tok].float() @ a_stack[slot].float().T  # (R,)
        out[tok] = (y[tok].float() + b_stack[slot].float() @ t).to(y.dtype)  # (N,)
    return out
