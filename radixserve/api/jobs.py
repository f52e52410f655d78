"""How a request becomes its choices: the prompt, context and max_tokens checks under the
server's and the caller's caps, resolving max_tokens, prompts x n ChoiceJobs with their seeds,
and merging the n choices' streams into one.

Owns: ChoiceJob (what one choice asks the engine for), JobCaps (the bounds a request is
checked against), make_jobs, and merge_streams. Pure decisions over a parsed request.
Does not know: tokenization, admission and per-key accounting, detokenizing a choice
(server/choice_stream.py), the engine, HTTP, OpenAI's wire format. Errors are APIError 400s
naming the offending parameter.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncGenerator, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, TypeVar

from radixserve.api.api_keys import KeyLimits
from radixserve.api.errors import APIError
from radixserve.api.lengths import (
    check_token_ids,
    choice_seed,
    context_length_message,
    prompt_too_long_message,
)
from radixserve.api.protocol import RequestOptions
from radixserve.types import SamplingParams

T = TypeVar("T")
NO_LIMITS = KeyLimits()  # an anonymous caller's: only the server's caps apply


@dataclass(frozen=True)
class ChoiceJob:
    index: int
    prompt_index: int  # which prompt of a batched completions request
    rid: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    stop: tuple[str, ...]
    cache_salt: str
    priority: int = 0
    prediction_ids: tuple[int, ...] = ()  # OpenAI's `prediction`, tokenized (a draft source)
    # The last N prompt ids are this choice's own earlier output (native
    # `continue_output_tokens`): the detokenizer and stop matcher replay them.
    num_continued: int = 0


@dataclass(frozen=True)
class JobCaps:
    """The server-wide bounds of one request: the model's (known once it loaded) and the
    flags' (--max-tokens-cap, --max-input-tokens; None: unbounded)."""

    max_model_len: int
    vocab_size: int
    max_tokens_cap: int | None
    max_input_tokens: int | None


def finalize_params(caps: JobCaps, params: SamplingParams, prompt_len: int, param: str,
                    limits: KeyLimits = NO_LIMITS) -> SamplingParams:
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
        raise APIError(400, prompt_too_long_message(limit, prompt_len), param=param,
                       code="context_length_exceeded")
    if params.max_tokens is None:
        return dataclasses.replace(params, max_tokens=room if cap is None else min(room, cap))
    if cap is not None and params.max_tokens > cap:
        raise APIError(400, f"max_tokens ({params.max_tokens}) exceeds this server's cap "
                            f"({cap})", param="max_tokens")
    if params.max_tokens > room:
        raise APIError(400, context_length_message(limit, prompt_len, params.max_tokens),
                       param="max_tokens", code="context_length_exceeded")
    return params


def make_jobs(caps: JobCaps, prompts: Sequence[list[int]], opts: RequestOptions, salt: str,
              param: str, limits: KeyLimits = NO_LIMITS) -> list[ChoiceJob]:
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
                choice_params = dataclasses.replace(params, seed=choice_seed(params.seed, i))
            jobs.append(ChoiceJob(len(jobs), p_idx, uuid.uuid4().hex, tuple(ids),
                                  choice_params, opts.stop, salt, opts.priority or 0))
    return jobs


def tightest(*limits: Any) -> Any:
    """The smallest of the limits that are set (None when none is)."""
    given = [x for x in limits if x is not None]
    return min(given) if given else None


async def merge_streams(
    streams: list[AsyncGenerator[T, None]],
) -> AsyncGenerator[T, None]:
    """Interleave several streams as items arrive; closing the merge closes every stream."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for item in only:
                yield item
        return
    queue: asyncio.Queue[tuple[Any, BaseException | None]] = asyncio.Queue()
    done = object()

    async def pump(stream: AsyncGenerator[T, None]) -> None:
        try:
            async with aclosing(stream) as items:
                async for item in items:
                    queue.put_nowait((item, None))
        except Exception as err:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((done, err))
            return
        queue.put_nowait((done, None))

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        remaining = len(tasks)
        while remaining:
            item, err = await queue.get()
            if err is not None:
                raise err
            if item is done:
                remaining -= 1
                continue
            yield item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
