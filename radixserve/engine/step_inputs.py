"""StepInputs: one forward's token rows, positions, attention metadata and logit rows.

Owns: the shape of what the model runner hands the model (eagerly or through a CUDA graph's
static buffers). Does not know: requests, how the rows were chosen.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.attention.base import AttentionMetadata


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    meta: AttentionMetadata
    logit_rows: torch.Tensor  # (N,)
