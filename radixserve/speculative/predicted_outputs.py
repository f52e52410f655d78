"""OpenAI's Predicted Outputs as a draft source, followed along the output.

The client's `prediction` text, tokenized.

Owns: the alignment rule. While the output so far equals the prediction up to `pos`, the draft
is prediction[pos : pos + k]. When the output departs from it (an edit), the alignment is
found again from the output's last n tokens, preferring the first match at or after the last
aligned position (an edited file is rewritten front to back), else the latest before it.
Does not know: requests, the scheduler (it keeps the position in the request's SpecState).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from radixserve.speculative.ngram import TokenArray

RESYNC_MIN = 2  # shortest output tail used to find the alignment again


def match_ends(haystack: TokenArray, pattern: TokenArray) -> npt.NDArray[np.int64]:
    """Every index e with haystack[e - len(pattern) : e] == pattern, ascending."""
    n = len(pattern)
    if n == 0 or len(haystack) < n:
        return np.zeros(0, dtype=np.int64)
    starts = np.flatnonzero(haystack[n - 1 :] == pattern[-1])
    for j in range(n - 1):
        if not len(starts):
            break
        starts = starts[haystack[starts + j] == pattern[j]]
    return (starts + n).astype(np.int64)


def realign(prediction: TokenArray, output: TokenArray, hint: int, n_max: int) -> int | None:
    """The prediction position that continues `output` (None: no alignment found)."""
    if len(output) == 0:
        return 0
    for n in range(min(n_max, len(output)), RESYNC_MIN - 1, -1):
        ends = match_ends(prediction, output[len(output) - n :])
        ends = ends[ends < len(prediction)]  # something left to draft
        if len(ends):
            after = ends[ends >= hint]
            return int(after[0]) if len(after) else int(ends[-1])
    return None


def advance(prediction: TokenArray, pos: int | None, new_tokens: list[int]) -> int | None:
    """The aligned position after appending new_tokens, None when they leave the prediction
    (the next draft realigns)."""
    if pos is None:
        return None
    end = pos + len(new_tokens)
    if end <= len(prediction) and prediction[pos:end].tolist() == new_tokens:
        return end
    return None
