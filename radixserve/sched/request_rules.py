"""Per-request rules the scheduler applies: its max_new_tokens, and which token ends it.

What a new request may ask for (its resolved max_new_tokens) and whether a sampled token ends
it (stop_reason).

Owns: pure decisions over one request (the stop test also advances the request's grammar
matcher, which the scheduler owns through the Req). The length and range rules themselves are
radixserve/api/lengths.py's, shared with the HTTP server and the offline LLM.
Does not know: queues, pages, tensors.
"""

from __future__ import annotations

import logging

from radixserve.api.lengths import check_ids_in_vocab, context_length_message
from radixserve.sched.req import Req
from radixserve.types import FinishReason, InvalidRequestError, SamplingParams

logger = logging.getLogger(__name__)


def checked_max_new_tokens(prompt_ids: list[int], params: SamplingParams, vocab_size: int,
                           max_model_len: int) -> int:
    """The request's resolved max_new_tokens. Raises InvalidRequestError (the caller's 4xx)."""
    n = len(prompt_ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty", "prompt")
    check_ids_in_vocab(prompt_ids, vocab_size, "prompt")
    if params.bias_pairs:
        check_ids_in_vocab((params.bias_pairs[-1][0],), vocab_size, "logit_bias")
    max_new = params.max_tokens if params.max_tokens is not None else max_model_len - n
    if n + max(max_new, 1) > max_model_len:
        raise InvalidRequestError(context_length_message(max_model_len, n, max_new),
                                  "max_tokens")
    return max_new


def stop_reason(req: Req, token: int, eos_token_ids: frozenset[int],
                max_model_len: int) -> FinishReason | None:
    """Why `token` (already appended to req) ends req, or None. Advances req.grammar."""
    p = req.params
    if req.grammar is not None and not req.grammar.accept(token):
        # The mask allowed only grammar tokens: a bug, not a user error. End this request
        # rather than the engine.
        logger.error("%s: token %d outside its grammar: %s", req.rid, token, req.grammar.error)
        return FinishReason.STOP
    if req.num_output_tokens >= p.min_tokens and (
        token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids)
    ):
        return FinishReason.STOP
    if req.grammar is not None and req.grammar.terminated:
        return FinishReason.STOP  # the grammar admits nothing more
    if req.num_output_tokens >= req.max_new_tokens or req.num_tokens >= max_model_len:
        return FinishReason.LENGTH
    return None
