"""Sizing a request into engine jobs: the prompt, context and max_tokens checks under the
server's and the caller's caps, resolving max_tokens, and prompts x n choices with their seeds.

Owns: pure decisions over a parsed request and the bounds it is checked against (JobCaps).
Does not know: tokenization, admission and per-key accounting, streaming (state.py), the
engine, OpenAI's wire format. Errors are APIError 400s naming the offending parameter.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from radixserve.server.auth import ANONYMOUS_CALLER
from radixserve.server.errors import APIError
from radixserve.server.generation import ChoiceJob
from radixserve.server.keys import KeyLimits
from radixserve.server.protocol import RequestOptions, check_token_ids
from radixserve.types import SamplingParams

INT64_SPAN = 2**64


@dataclass(frozen=True)
class JobCaps:
    """The server-wide bounds of one request: the model's (known once it loaded) and the
    flags' (--max-tokens-cap, --max-input-tokens; None: unbounded)."""

    max_model_len: int
    vocab_size: int
    max_tokens_cap: int | None
    max_input_tokens: int | None


def finalize_params(caps: JobCaps, params: SamplingParams, prompt_len: int, param: str,
                    limits: KeyLimits = ANONYMOUS_CALLER.limits) -> SamplingParams:
    """Check the prompt against the limits and fix max_tokens (None: remaining context).

    A key's max_tokens / max_input_tokens tighten the server's caps, never loosen them."""
    limit = caps.max_model_len
    cap = tightest(caps.max_tokens_cap, limits.max_tokens)
    max_input = tightest(caps.max_input_tokens, limits.max_input_tokens)
    if max_input is not None and prompt_len > max_input:
        raise APIError(400, f"the prompt has {prompt_len} tokens; this server accepts at most "
                            f"{max_input}", param=param, code="input_too_long")
    room = limit - prompt_len
    if room < 1:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, "
                            f"the prompt has {prompt_len} tokens.", param=param,
                       code="context_length_exceeded")
    if params.max_tokens is None:
        return dataclasses.replace(params, max_tokens=room if cap is None else min(room, cap))
    if cap is not None and params.max_tokens > cap:
        raise APIError(400, f"max_tokens ({params.max_tokens}) exceeds this server's cap "
                            f"({cap})", param="max_tokens")
    if params.max_tokens > room:
        raise APIError(400, f"This model's maximum context length is {limit} tokens. However, "
                            f"you requested {prompt_len + params.max_tokens} tokens "
                            f"({prompt_len} in the prompt, {params.max_tokens} in the "
                            "completion).", param="max_tokens",
                       code="context_length_exceeded")
    return params


def make_jobs(caps: JobCaps, prompts: Sequence[list[int]], opts: RequestOptions, salt: str,
              param: str, limits: KeyLimits = ANONYMOUS_CALLER.limits) -> list[ChoiceJob]:
    """prompts x n choices; choice i of a seeded request samples with seed + i."""
    if opts.params.stop_token_ids:
        check_token_ids(opts.params.stop_token_ids, caps.vocab_size, "stop_token_ids")
    if opts.params.logit_bias:
        check_token_ids(tuple(t for t, _ in opts.params.bias_pairs), caps.vocab_size,
                        "logit_bias")
    jobs: list[ChoiceJob] = []
    for p_idx, ids in enumerate(prompts):
        params = finalize_params(caps, opts.params, len(ids), param, limits)
        for i in range(opts.n):
            choice_params = params
            if params.seed is not None and i:
                choice_params = dataclasses.replace(params, seed=wrap_int64(params.seed + i))
            jobs.append(ChoiceJob(len(jobs), p_idx, uuid.uuid4().hex, tuple(ids),
                                  choice_params, opts.stop, salt, opts.priority or 0))
    return jobs


def wrap_int64(value: int) -> int:
    return (value + 2**63) % INT64_SPAN - 2**63


def tightest(*limits: Any) -> Any:
    """The smallest of the limits that are set (None when none is)."""
    given = [x for x in limits if x is not None]
    return min(given) if given else None
