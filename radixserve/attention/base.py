"""The attention-backend seam: metadata every backend reads, and the backend protocol.

Owns: AttentionMetadata (built once per forward by the model runner, read by every layer),
the AttentionBackend protocol and StoredKVAttention (a backend that can also attend over
K/V the model stored itself, e.g. fused with RoPE). Does not know: how a backend computes attention.

KV layout (shared with triton_kernels/): per layer, K and V are (num_slots, kv_heads, head_dim)
tensors; slot = page * page_size + offset. `slot_table[row, i]` is the slot of token i of the
request in table row `row`. A forward first stores its new tokens' K/V at `out_slots`, then
each new token at absolute position p attends to slots slot_table[row, 0 : p + 1].
The model runner writes the table rows of a batch before building this metadata.

Names: the per-request counts keep the kernels' (SGLang's) words: `prefix_lens` are a
request's num_computed_tokens before this forward, `extend_lens` its num_new_tokens (a
prefill chunk's length, or 1 for a decode).

Per-call options (per layer: Gemma mixes sliding and global layers in one forward; both are
constants of a layer, never per-step data, so a CUDA graph captures them as they are):
- `window: int | None`: sliding-window attention as HF's `sliding_window` (transformers'
  masking_utils.sliding_window_overlay: key kv is visible to query q iff kv > q - window):
  the new token at absolute position p attends to positions max(0, p - window + 1) .. p, i.e.
  the last `window` positions including itself. None: full causal attention.
- `softcap: float | None`: logit soft-capping (Gemma 2's attn_logit_softcapping): each scaled
  score s = (q . k) * scale becomes softcap * tanh(s / softcap) before the softmax (and before
  the window's mask). None: no capping.
Defaults (None, None) are the plain causal attention every caller had before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from radixserve.attention.kv_quant import KVScale
from radixserve.types import Phase


def check_window_softcap(window: int | None, softcap: float | None) -> None:
    """The per-call options' contract (module docstring); a bad value is a caller's bug."""
    if window is not None and window < 1:
        raise ValueError(f"sliding window must be >= 1 token, got {window}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"logit soft-cap must be > 0, got {softcap}")


def window_start(position: int, window: int | None) -> int:
    """The first position a token at `position` attends to (0 without a window)."""
    return 0 if window is None else max(0, position - window + 1)


@dataclass(frozen=True)
class SharedPrefix:
    """Requests of a decode batch whose first `length` KV slots are the same tree pages.

    A backend may attend to those slots once for the whole group (one gather, one matmul)
    and merge with each request's own part by log-sum-exp; it may also ignore this (a
    windowed call must, or cut the group's part to each token's window: a window may end
    inside a shared prefix).
    """

    members: torch.Tensor  # (n,) int64 batch indices
    slots: torch.Tensor  # (length,) int64
    length: int
    # Host-side copies, so that planning a forward needs no device sync.
    members_cpu: tuple[int, ...] = ()
    first_slot: int | None = None  # set when slots are first, first + 1, ... (a view suffices)


@dataclass(frozen=True)
class AttentionMetadata:
    phase: Phase
    slot_table: torch.Tensor  # (max_reqs, max_model_len) int32
    rows: torch.Tensor  # (B,) int64: table row of each request in the batch
    prefix_lens: torch.Tensor  # (B,) int32: tokens with KV before this forward
    extend_lens: torch.Tensor  # (B,) int32: new tokens this forward (decode: all 1)
    seq_lens: torch.Tensor  # (B,) int32: prefix_lens + extend_lens
    cu_extend: torch.Tensor  # (B + 1,) int32: offsets of each request's new tokens in q
    out_slots: torch.Tensor  # (T,) int64: where the new tokens' K/V are stored
    # Host-side copies, known from the batch without a device sync.
    prefix_lens_cpu: tuple[int, ...]
    extend_lens_cpu: tuple[int, ...]
    max_seq_len: int
    max_extend_len: int
    rows_cpu: tuple[int, ...] = ()
    # Decode only, optional: shared tree prefixes, and where each request's own part starts
    # (0 for a request in no group). Backends that ignore them stay correct.
    shared: tuple[SharedPrefix, ...] = ()
    own_start: torch.Tensor | None = None  # (B,) int64
    own_start_cpu: tuple[int, ...] = ()

    @property
    def batch_size(self) -> int:
        return len(self.extend_lens_cpu)


class AttentionBackend(Protocol):
    """Stores this forward's K/V into the pool, then attends through the slot table.

    An 8-bit pool (--kv-cache-dtype fp8*) comes with the layer's scales (attention/kv_quant.py):
    the backend stores x / scale in 8 bits and reads stored * scale; None for a pool in the
    model's dtype. `window` and `softcap`: the module docstring's per-call options.
    """

    @property
    def reads_shared_prefixes(self) -> bool:
        """Whether forward() reads a decode batch's shared tree prefixes (meta.shared,
        own_start); the model runner builds them only for a backend that does."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # (T, num_q_heads, head_dim)
        k: torch.Tensor,  # (T, num_kv_heads, head_dim)
        v: torch.Tensor,  # (T, num_kv_heads, head_dim)
        k_cache: torch.Tensor,  # (num_slots, num_kv_heads, head_dim), written in place
        v_cache: torch.Tensor,  # (num_slots, num_kv_heads, head_dim), written in place
        meta: AttentionMetadata,
        scale: float,
        kv_scale: KVScale | None = None,
        *,
        window: int | None = None,  # sliding window (HF's sliding_window); None: causal
        softcap: float | None = None,  # attention logit soft-cap; None: none
    ) -> torch.Tensor:  # (T, num_q_heads, head_dim)
        ...


@runtime_checkable
class StoredKVAttention(Protocol):
    """A backend that can skip its own store: this forward's K/V are already in the pool at
    `meta.out_slots` (written by the model: triton_kernels.rope_qk_store on the fused path,
    norm_rope's native rope_store on CPU)."""

    @property
    def fused_kernels(self) -> bool:
        """Whether the model runs its Triton fused layers with this backend (the Triton
        backend); False: only the CPU loop's native RoPE + store uses attend()."""
        ...

    def attend(
        self,
        q: torch.Tensor,  # (T, num_q_heads, head_dim), any token stride
        k_cache: torch.Tensor,  # (num_slots, num_kv_heads, head_dim)
        v_cache: torch.Tensor,  # (num_slots, num_kv_heads, head_dim)
        meta: AttentionMetadata,
        scale: float,
        kv_scale: KVScale | None = None,  # an 8-bit pool's scales of this layer
        *,
        window: int | None = None,  # as in AttentionBackend.forward
        softcap: float | None = None,
        check: bool = True,  # False: operands as the first layer's, already checked
    ) -> torch.Tensor:  # (T, num_q_heads, head_dim)
        ...
