"""Native CPU attention kernels: loading them at the process's tier, and their torch references.

Owns: the ops `paged_decode` and `prefill_attention` (csrc/paged_decode*.cpp and
csrc/prefill_attention*.cpp, one extension built per CPU tier: platform/kernels.py's
ATTENTION, loaded at the tier choose_tier picks, in torch.ops.radixserve_<tier>), and
`paged_decode_reference` / `prefill_attention_reference`, the same computations in plain
torch (the kernels' specifications, and what tests compare them with). Does not know:
metadata, plans, the cascade (the torch backend and varlen.py decide when a kernel applies),
building or tiers (platform/native_build.py, platform/cpu_isa.py).

If no tier builds (no compiler, no ninja, an unusual platform), the loaders return None and
the caller keeps its torch path.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from radixserve.platform.kernels import ATTENTION, ENV_DISABLE, load_extension
from radixserve.platform.native_build import ENV_RETRY, ninja_on_path

__all__ = ["ENV_DISABLE", "ENV_RETRY", "ninja_on_path"]

# "1": the 8-bit decode kernel keeps its AVX512-BF16 path on an AMX CPU (read once per process by
# csrc/paged_decode_fp8_amx.cpp; to compare or test the two paths)
ENV_NO_AMX = "RADIXSERVE_NO_AMX"

# prefill_attention's head dims (template instances in the kernel); others keep the torch path
PREFILL_HEAD_DIMS = (32, 64, 128)

PagedDecode = Callable[..., tuple[torch.Tensor, torch.Tensor]]
PrefillAttention = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def load_paged_decode() -> PagedDecode | None:
    """paged_decode at the process's tier, built on first use; None where unavailable."""
    loaded = load_extension(ATTENTION)
    return None if loaded is None else loaded.op("paged_decode")


def load_prefill_attention() -> PrefillAttention | None:
    """prefill_attention at the process's tier, built on first use; None where unavailable."""
    loaded = load_extension(ATTENTION)
    return None if loaded is None else loaded.op("prefill_attention")


def cap_scores(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Logit soft-capping (Gemma 2): softcap * tanh(scores / softcap); None: as they are."""
    return scores if softcap is None else softcap * torch.tanh(scores / softcap)


def paged_decode_reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           slot_table: torch.Tensor, rows: torch.Tensor, starts: torch.Tensor,
                           seq_lens: torch.Tensor, scale: float, softcap: float | None = None
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel computes, in float64, request by request.

    q (B, Hq, D); k_cache, v_cache (S, Hkv, D); slot_table (R, Lmax) int32; rows, starts,
    seq_lens (B,). Request b's query attends to slots slot_table[rows[b], starts[b]:seq_lens[b]]
    (a sliding window W is starts[b] raised to seq_lens[b] - W); softcap: the scaled scores
    soft-capped before the softmax (the kernel's `softcap=`; None there is 0).
    Returns out (B, Hq, D) in q's dtype and lse (B, Hq) float32.
    """
    B, Hq, D = q.shape
    G = Hq // k_cache.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty(B, Hq, dtype=torch.float32, device=q.device)
    for b in range(B):
        slots = slot_table[int(rows[b]), int(starts[b]):int(seq_lens[b])].long()
        keys = k_cache[slots].double().repeat_interleave(G, dim=1)  # (L, Hq, D)
        values = v_cache[slots].double().repeat_interleave(G, dim=1)
        scores = cap_scores(torch.einsum("hd,lhd->hl", q[b].double(), keys) * scale,
                            softcap)  # (Hq, L)
        lse[b] = torch.logsumexp(scores, dim=-1).float()
        probs = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("hl,lhd->hd", probs, values).to(q.dtype)
    return out, lse


def prefill_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                                k_cache: torch.Tensor, v_cache: torch.Tensor,
                                prefix_slots: torch.Tensor, scale: float,
                                softcap: float | None = None, window: int | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """What prefill_attention computes, in float64.

    q (M, Hq, D), k/v (M, Hkv, D): one request's chunk; prefix_slots (P,) int32: its cached
    keys' slots in k_cache/v_cache (S, Hkv, D). Query i attends to the P prefix keys and to
    the chunk's keys 0..i; with a window W, only to keys P + i - W + 1 .. P + i of that index
    space (the prefix keys consecutive positions ending just before the chunk). softcap: the
    scaled scores soft-capped before the softmax. (The kernel takes `softcap=`, `window=`;
    0 there is None.) Returns out (M, Hq, D) in q's dtype and lse (M, Hq) float32.
    """
    M, Hq, _ = q.shape
    G = Hq // k.shape[1]
    slots = prefix_slots.long()
    keys = torch.cat([k_cache[slots], k]).double().repeat_interleave(G, dim=1)  # (P+M, Hq, D)
    values = torch.cat([v_cache[slots], v]).double().repeat_interleave(G, dim=1)
    P = slots.numel()
    scores = cap_scores(torch.einsum("mhd,lhd->hml", q.double(), keys) * scale,
                        softcap)  # (Hq, M, P+M)
    query = P + torch.arange(M, device=q.device)  # (M,) key index of each query
    key = torch.arange(P + M, device=q.device)  # (P+M,)
    hidden = key[None, :] > query[:, None]  # (M, P+M): causal
    if window is not None:
        hidden |= key[None, :] <= query[:, None] - window
    scores = scores.masked_fill(hidden, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # (Hq, M)
    out = torch.einsum("hml,lhd->mhd", torch.softmax(scores, dim=-1), values)
    return out.to(q.dtype), lse.transpose(0, 1).float().contiguous()
