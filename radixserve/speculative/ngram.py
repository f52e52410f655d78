"""Prompt lookup: draft what followed the latest earlier occurrence of the last n tokens.

n runs from prompt_lookup_max down to prompt_lookup_min.

Owns: the vectorized search over one int32 token array (candidates are the positions of the
last token; only those are checked against the rest of the n-gram). Does not know: requests,
where the array came from (the request's own tokens, a prediction, an index of recent outputs).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

TokenArray = npt.NDArray[np.int32]


def as_tokens(ids: Any) -> TokenArray:
    return np.asarray(ids, dtype=np.int32)


def lookup(haystack: TokenArray, pattern: TokenArray, max_draft: int,
           end: int | None = None) -> TokenArray:
    """The (up to max_draft) tokens after the latest occurrence of `pattern` in
    haystack[:end] that has at least one token after it (inside haystack); empty if none."""
    n = len(pattern)
    limit = len(haystack) if end is None else end
    if n == 0 or max_draft <= 0 or limit <= n:
        return haystack[:0]
    # Candidate starts s with haystack[s + n - 1] == pattern[-1], s + n < len(haystack).
    last = haystack[n - 1 : min(limit, len(haystack) - 1)]  # (limit - n,)
    starts = np.flatnonzero(last == pattern[-1])
    for j in range(n - 1):  # narrow by the remaining pattern tokens
        if not len(starts):
            return haystack[:0]
        starts = starts[haystack[starts + j] == pattern[j]]
    if not len(starts):
        return haystack[:0]
    s = int(starts[-1]) + n
    return haystack[s : s + max_draft]


def ngram_draft(tokens: TokenArray, max_draft: int, n_min: int, n_max: int) -> TokenArray:
    """Prompt lookup in the sequence itself: its last n tokens searched in what precedes
    them, longest n first."""
    total = len(tokens)
    for n in range(min(n_max, total - 1), n_min - 1, -1):
        draft = lookup(tokens, tokens[total - n :], max_draft, end=total - 1)
        if len(draft):
            return draft
    return tokens[:0]


def suffix_draft(haystack: TokenArray, tokens: TokenArray, max_draft: int, n_min: int,
                 n_max: int) -> TokenArray:
    """The last n tokens of `tokens` searched in another array (a prediction, recent
    outputs), longest n first."""
    for n in range(min(n_max, len(tokens)), n_min - 1, -1):
        draft = lookup(haystack, tokens[len(tokens) - n :], max_draft)
        if len(draft):
            return draft
    return tokens[:0]
