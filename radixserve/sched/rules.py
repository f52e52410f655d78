"""Per-request rules the scheduler applies: what a new request may ask for, and whether a
sampled token ends its request.

Owns: pure decisions over one request (the stop test also advances the request's grammar
matcher, which the scheduler owns through the Req). Does not know: queues, pages, tensors.
"""

from __future__ import annotations

import logging

from radixserve.sched.req import Req
from radixserve.types import FinishReason, InvalidRequestError, SamplingParams

logger = logging.getLogger(__name__)


def checked_max_new_tokens(prompt_ids: list[int], params: SamplingParams, vocab_size: int,
                           max_model_len: int) -> int:
    """The request's resolved max_new_tokens. Raises InvalidRequestError (the caller's 4xx)."""
    n = len(prompt_ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty", "prompt")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    if params.bias_pairs and params.bias_pairs[-1][0] >= vocab_size:
        raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab_size}), got "
                                  f"{params.bias_pairs[-1][0]}", "logit_bias")
    max_new = params.max_tokens if params.max_tokens is not None else max_model_len - n
    if n + max(max_new, 1) > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, "
            f"you requested {n + max_new} tokens ({n} in the prompt, {max_new} in the "
            f"completion). Please reduce the prompt or max_tokens.", "max_tokens")
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
