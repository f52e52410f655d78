"""Drafter: picks one draft per request and step from the configured sources.

Owns: SpecState (a request's prediction, its alignment, its adaptive draft length and its
draft/accept counts; held by the Req, written only on the scheduler's behalf) and the choice
among sources: the client's prediction, prompt lookup (`ngram`), the radix tree's
continuations and the recent-outputs index (`radix`), or all of them (`auto`: the longest
draft). A constrained request drafts the tokens its grammar forces (jump-forward) when there
are any, else a source's draft cut to its longest grammar-valid prefix.
Does not know: batches, slots, tensors, verification (acceptance.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from radixserve.cache.radix_cache import RadixCache
from radixserve.config.speculative_config import SpeculativeConfig
from radixserve.grammar.backend import Matcher
from radixserve.speculative import predicted_outputs as pred
from radixserve.speculative.acceptance import DraftLength
from radixserve.speculative.ngram import TokenArray, as_tokens, ngram_draft
from radixserve.speculative.radix_drafts import RecentOutputs, tree_continuation

PREDICTION_MAX_DRAFT = 8  # a client's prediction drafts this many tokens without a flag
PREDICTION_NGRAM_MAX = 8  # output tail used to realign a prediction after an edit


@dataclass
class SpecState:
    """Speculation state of one request."""

    length: DraftLength
    prediction: TokenArray | None = None
    pred_pos: int | None = 0  # prediction index continuing the output; None: lost
    num_drafted: int = 0  # draft tokens verified, over the request's life
    num_accepted: int = 0  # of them, accepted
    # The request's tokens as int32, converted as they are appended (not O(len) a step).
    _buf: TokenArray = field(default_factory=lambda: np.empty(0, np.int32))
    _len: int = 0

    def tokens(self, token_ids: Sequence[int]) -> TokenArray:
        """`token_ids` as an int32 array (a view, valid until the next call). A request's
        tokens only grow, so only the tail appended since the last call is converted."""
        n = len(token_ids)
        if n < self._len or (self._len and token_ids[self._len - 1] != self._buf[self._len - 1]):
            self._len = 0  # not an extension of what we saw: convert again
        if n > len(self._buf):
            grown = np.empty(max(2 * n, 256), np.int32)  # (capacity,): room to append
            grown[: self._len] = self._buf[: self._len]
            self._buf = grown
        if n > self._len:
            self._buf[self._len : n] = token_ids[self._len : n]
            self._len = n
        return self._buf[:n]


@dataclass(frozen=True)
class DraftRequest:
    """What a draft is made from (the scheduler's view of one running request)."""

    token_ids: Sequence[int]
    num_prompt_tokens: int
    salt: str
    grammar: Matcher | None
    max_draft: int  # the budget: remaining tokens, context, the adaptive length


class Drafter:
    def __init__(self, cfg: SpeculativeConfig | None, cache: RadixCache) -> None:
        self.cfg = cfg
        self.cache = cache
        self.recent = RecentOutputs(cfg.recent_output_tokens if cfg is not None
                                    and cfg.method in ("radix", "auto") else 0)

    @property
    def max_len(self) -> int:
        return self.cfg.num_speculative_tokens if self.cfg is not None else PREDICTION_MAX_DRAFT

    def new_state(self, prediction_ids: Sequence[int] | None) -> SpecState | None:
        """The state of a new request; None when nothing can draft for it."""
        if self.cfg is None and not prediction_ids:
            return None
        max_len = max(self.max_len, PREDICTION_MAX_DRAFT if prediction_ids else 0)
        state = SpecState(DraftLength(max_len))
        if prediction_ids:
            state.prediction = as_tokens(list(prediction_ids))
        return state

    def propose(self, state: SpecState, req: DraftRequest) -> list[int]:
        k = req.max_draft
        if k <= 0:
            return []
        if req.grammar is not None:
            forced = req.grammar.forced_tokens()
            if forced:
                return forced[:k]
        best: list[int] = []
        for draft in self._sources(state, req, k):
            if len(draft) > len(best):
                best = draft
                if len(best) >= k:
                    break
        if req.grammar is not None and best:
            best = best[: req.grammar.valid_prefix_len(best)]
        return best

    def _sources(self, state: SpecState, req: DraftRequest, k: int) -> list[list[int]]:
        """Each source's draft, most trusted first (the prediction: the client's own)."""
        out: list[list[int]] = []
        tokens: TokenArray | None = None
        if state.prediction is not None:
            tokens = state.tokens(req.token_ids)
            out.append(self._from_prediction(state, tokens[req.num_prompt_tokens :], k))
        method = self.cfg.method if self.cfg is not None else None
        if method in ("radix", "auto"):
            out.append(tree_continuation(self.cache, req.token_ids, req.salt, k))
        if method is None or (out and len(out[-1]) >= k):
            return out
        tokens = state.tokens(req.token_ids) if tokens is None else tokens
        cfg = self.cfg
        assert cfg is not None
        if method in ("ngram", "auto"):
            out.append(ngram_draft(tokens, k, cfg.prompt_lookup_min,
                                   cfg.prompt_lookup_max).tolist())
        if method in ("radix", "auto"):
            out.append(self.recent.draft(req.salt, tokens, k, cfg.prompt_lookup_min,
                                         cfg.prompt_lookup_max).tolist())
        return out

    @staticmethod
    def _from_prediction(state: SpecState, output: TokenArray, k: int) -> list[int]:
        p = state.prediction
        assert p is not None
        if state.pred_pos is None:
            state.pred_pos = pred.realign(p, output, 0, PREDICTION_NGRAM_MAX)
        if state.pred_pos is None:
            return []
        draft: list[int] = p[state.pred_pos : state.pred_pos + k].tolist()
        return draft

    def on_tokens(self, state: SpecState, output: Sequence[int], new_tokens: list[int]) -> None:
        """Advance the prediction's alignment over tokens just appended (`output`: the whole
        output so far, including them)."""
        p = state.prediction
        if p is None:
            return
        hint = state.pred_pos if state.pred_pos is not None else 0
        state.pred_pos = pred.advance(p, state.pred_pos, new_tokens)
        if state.pred_pos is None:
            state.pred_pos = pred.realign(p, as_tokens(list(output)), hint, PREDICTION_NGRAM_MAX)

    def on_verified(self, state: SpecState, num_drafted: int, num_accepted: int) -> None:
        state.num_drafted += num_drafted
        state.num_accepted += num_accepted
        state.length.observe(num_drafted, num_accepted)

    def on_finish(self, salt: str, output_ids: Sequence[int]) -> None:
        self.recent.add(salt, output_ids)
