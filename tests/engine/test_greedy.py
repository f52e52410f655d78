"""The sampler's greedy choice on CPU equals torch's first maximal index over the whole row:
the torch form (blocked: amax per block of the vocabulary, then the first maximal index
inside the first block holding the max) and the native op (engine/csrc/greedy.cpp, at every
tier this host runs): ties inside a block and across blocks, -inf rows from a mask, NaNs (the
native op: the first NaN, as torch's max), and vocabularies the block does not divide."""

from __future__ import annotations

import pytest
import torch

from radixserve.engine.sampler import GREEDY_BLOCK, _greedy, load_greedy_argmax


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


@pytest.mark.usefixtures("cpu_tier")
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 40, 1024, GREEDY_BLOCK * 40 + 3])
def test_native_greedy_is_torchs_first_maximal_index(vocab: int) -> None:
    native = load_greedy_argmax(torch.device("cpu"))
    assert native is not None, "the op must build where the tests run (gcc + ninja)"
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(12, vocab, generator=g)
    last = vocab - 1
    logits[0, [last // 3, last]] = 50.0  # a tie: the first
    logits[1, :] = 7.0  # every token ties: token 0
    logits[2, :last] = float("-inf")  # masked but the last
    logits[3, :] = float("-inf")  # all masked: token 0
    logits[4, last // 2] = float("inf")
    logits[5] = logits[5].round()  # many ties
    logits[6, [last // 2, last]] = float("nan")  # the first NaN
    logits[7, last] = float("nan")  # a NaN in the tail
    logits[8, 0] = float("nan")  # a NaN first, then larger values
    logits[9, 1:] = 100.0
    logits[9, 0] = float("nan")
    logits[10, :] = -0.0
    logits[10, last] = 0.0  # -0 == +0: token 0
    want = logits.max(dim=-1).indices
    assert torch.equal(_greedy(logits, native), want)
    wide = torch.randn(12, vocab + 5, generator=g)
    wide[:, :vocab] = logits
    assert torch.equal(_greedy(wide[:, :vocab], native), want)  # rows vocab + 5 apart
