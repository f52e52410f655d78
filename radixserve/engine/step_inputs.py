"""StepInputs: one forward's token rows, positions, attention metadata and logit rows.

Owns: the shape of what the model runner hands the model (eagerly or through a CUDA graph's
static buffers), and the slot-table writes a step carries (write_slot_table: the runner
applies them, and so does every tensor-parallel worker with the same arguments).
Does not know: requests, how the rows were chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.attention.base import AttentionMetadata
from radixserve.model.lora_delta import LoRABatch


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # (N,)
    # The older table entries this step writes (a new row, adopted tree pages): rows,
    # positions and slots; None when there are none.
    table_back: torch.Tensor | None = None  # (3, W) int64
    lora: LoRABatch | None = None  # the rows' adapter segments; None: base model only


def back_writes(back: list[tuple[int, int, list[int]]], device: torch.device
                ) -> torch.Tensor | None:
    """(row, first position, slots) entries as one (3, W) int64 tensor of table writes."""
    if not back:
        return None
    b_rows: list[int] = []
    b_pos: list[int] = []
    b_slots: list[int] = []
    for row, start, slots in back:
        b_rows += [row] * len(slots)
        b_pos += range(start, start + len(slots))
        b_slots += slots
    return torch.tensor([b_rows, b_pos, b_slots], dtype=torch.int64).to(device, non_blocking=True)


def write_slot_table(table: torch.Tensor, meta: AttentionMetadata, positions: torch.Tensor,
                     back: torch.Tensor | None) -> None:
    """slot_table[row, p] = slot for every token this step computes (one scatter), and for
    the older positions in `back`. `table`: (max_reqs, max_model_len) int32."""
    rows, out_slots = meta.rows, meta.out_slots
    token_rows = rows if rows.numel() == positions.numel() else torch.repeat_interleave(
        rows, meta.extend_lens, output_size=positions.numel())  # (T,)
    table[token_rows, positions] = out_slots.to(table.dtype)
    if back is not None:
        table[back[0], back[1]] = back[2].to(table.dtype)
