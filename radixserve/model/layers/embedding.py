"""The token embedding and the LM head, vocabulary-parallel under TP, with Gemma's embedding
scale and final logit soft-cap.

Owns: the embedding lookup (under TP: each rank's vocabulary rows, the other rows zeroed,
then one all-reduce), the LM head over the rows that sample, the gather of the ranks'
vocabulary shards to rank 0, and the soft-cap. Does not know: the decoder layers, configs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixserve.model.layers.linear import LinearKernel

if TYPE_CHECKING:
    from radixserve.parallel.comm import TPComm


class VocabEmbedding:
    """(T,) ids -> (T, hidden); `scale`: multiplied in the model dtype (Gemma's sqrt(hidden))."""

    def __init__(self, weight: torch.Tensor, vocab_range: tuple[int, int] | None,
                 tp: TPComm | None, scale: float | None = None) -> None:
        self.weight = weight  # (vocab or the rank's shard, hidden)
        self.vocab_range, self.tp = vocab_range, tp
        # HF multiplies by the scale as a tensor of the embeddings' dtype (rounded there).
        self.scale = None if scale is None else torch.tensor(scale, dtype=weight.dtype,
                                                             device=weight.device)

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            h = F.embedding(input_ids, self.weight)  # (T, hidden)
        else:
            assert self.vocab_range is not None
            start, end = self.vocab_range
            local = input_ids - start  # (T,)
            outside = (input_ids < start) | (input_ids >= end)  # (T,) another rank's row
            h = F.embedding(local.masked_fill(outside, 0), self.weight)  # (T, hidden)
            h.masked_fill_(outside.unsqueeze(1), 0.0)
            h = self.tp.all_reduce(h)  # exactly one rank contributes each row: no rounding
        return h if self.scale is None else h * self.scale


class LMHead:
    """(N, hidden) -> (N, vocab) float32 logits (under TP on rank 0: the shards gathered)."""

    def __init__(self, kernel: LinearKernel, vocab_size: int, tp: TPComm | None,
                 softcap: float | None = None) -> None:
        self.kernel, self.vocab_size, self.tp, self.softcap = kernel, vocab_size, tp, softcap

    @property
    def nbytes(self) -> int:
        return self.kernel.nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.kernel(x).float()  # (N, vocab or the rank's shard)
        if self.tp is not None:
            logits = self.tp.gather_vocab(logits, self.vocab_size)
        if self.softcap is not None:  # Gemma 2: cap * tanh(logits / cap)
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits
