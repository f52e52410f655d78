"""The KV pool: per-layer K and V tensors addressed by slot, their scales, and the slot table.

Owns: the device memory of the KV cache and of the (request row, token) -> slot table, and
their sizing. With an 8-bit cache (--kv-cache-dtype fp8*), also the scales of every (layer, KV
head) that the stored bytes are read with (attention/kv_quant.py; the model runner writes them
once, at start-up, before any K/V is stored). Does not know: which slots are free
(PageAllocator), which are cached (RadixCache), or which request holds what (the scheduler).

Layout: k and v are (num_layers, num_slots + 1, kv_heads, head_dim), one tensor each, so
k[layer] is a view; slot = page * page_size + offset. slot_table[row, i] is the slot of token
i of the request in `row`. The scheduler hands out the rows (numbers only); the model runner
is the table's one writer: before each forward it writes the slots of the tokens the batch
computes (and, for a new row or pages adopted from the tree, the older positions the batch
entry names), then attention reads it. Entries past a request's length are stale.

Padding (CUDA graphs, engine/graph_inputs.py): one slot past the allocator's range
(`pad_slot`) and one table row past the scheduler's (`pad_row`, every entry `pad_slot`).
A padding row of a fixed-shape batch stores its K/V at pad_slot and attends to it only, so
it writes nothing a request reads; nothing else ever hands these out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.attention.kv_quant import KVScale, is_fp8


@dataclass(frozen=True)
class KVPoolSize:
    num_pages: int
    page_size: int

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size


def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    return 2 * num_layers * num_kv_heads * head_dim * torch.tensor([], dtype=dtype).element_size()


class KVPool:
    def __init__(self, size: KVPoolSize, num_layers: int, num_kv_heads: int, head_dim: int,
                 max_reqs: int, max_model_len: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.size = size
        self.pad_slot = size.num_slots
        self.pad_row = max_reqs
        shape = (num_layers, size.num_slots + 1, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        # Zero-initialized so every entry is a valid slot index (the torch decode path
        # gathers a padded block and masks, so it reads past each request's length).
        self.slot_table = torch.zeros((max_reqs + 1, max_model_len), dtype=torch.int32,
                                      device=device)
        self.slot_table[self.pad_row] = self.pad_slot
        # (num_layers, kv_heads) float32 each: what an 8-bit pool's bytes are multiplied by.
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        if is_fp8(dtype):
            self.k_scale = torch.ones((num_layers, num_kv_heads), dtype=torch.float32,
                                      device=device)
            self.v_scale = torch.ones_like(self.k_scale)

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    @property
    def num_bytes(self) -> int:
        """The K and V tensors' bytes (the scales and the slot table aside)."""
        return self.k.nbytes + self.v.nbytes

    def layer_scales(self) -> list[KVScale] | None:
        """Per layer, views of its (k, v) scales; None for a pool in the model's dtype."""
        if self.k_scale is None or self.v_scale is None:
            return None
        return [KVScale(k, v) for k, v in zip(self.k_scale, self.v_scale, strict=True)]
