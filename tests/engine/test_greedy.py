"""The sampler's greedy choice on CPU (blocked: amax per block of the vocabulary, then the
first maximal index inside the first block holding the max) equals torch's first maximal
index over the whole row: ties inside a block and across blocks, -inf rows from a mask, and
vocabularies the block does not divide (the plain max)."""

from __future__ import annotations

import pytest
import torch

from radixserve.engine.sampler import GREEDY_BLOCK, _greedy


@pytest.mark.parametrize("vocab", [GREEDY_BLOCK * 40, GREEDY_BLOCK * 40 + 3, 3 * GREEDY_BLOCK])
def test_blocked_greedy_is_the_first_maximal_index(vocab: int) -> None:
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(9, vocab, generator=g)
    logits[0, [5, 9]] = 50.0  # a tie inside one block: the first
    logits[1, [GREEDY_BLOCK + 1, 3 * GREEDY_BLOCK - 1]] = 50.0  # a tie across blocks
    logits[2, :] = 7.0  # every token ties: token 0
    logits[3, :-1] = float("-inf")  # masked but the last
    logits[4, GREEDY_BLOCK - 1] = float("inf")
    logits[5] = logits[5].round()  # many ties
    logits[6, -1] = 60.0  # the very last token
    got = _greedy(logits)
    assert got.dtype == torch.int64
    assert torch.equal(got, logits.max(dim=-1).indices)
    assert got[:3].tolist() == [5, GREEDY_BLOCK + 1, 0] and got[3] == vocab - 1
    assert torch.equal(_greedy(logits[:, :GREEDY_BLOCK * 2]),  # a strided view: the plain max
                       logits[:, :GREEDY_BLOCK * 2].max(dim=-1).indices)
