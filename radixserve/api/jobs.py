"""A request as its choices (ChoiceJobs, under the caps), and their streams merged into one.

The prompt, context and max_tokens checks under the server's and the caller's caps,
resolving max_tokens, prompts x n ChoiceJobs with their seeds, and merging the n choices'
streams into one.

Owns: ChoiceJob (what one choice asks the engine for), JobCaps (the bounds a request is
checked against), make_jobs, and MergedStreams. Pure decisions over a parsed request.
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
from typing import Any, Generic, TypeVar

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
    lora_name: str | None = None  # the LoRA adapter `model` named (None: the base model)


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


class MergedStreams(Generic[T]):
    """Several streams read as one, items in arrival order: `await next()` gives the next item
    (StopAsyncIteration when every stream ended) and `aclose()` closes every stream.

    NOTE: deliberately not an async generator: the request's one outputs generator
    (server/app_state.py) awaits next() itself, so merging adds no generator to the path a
    token takes. One stream is read in place; several are pumped by tasks into a queue."""

    def __init__(self, streams: list[AsyncGenerator[T, None]]) -> None:
        self._streams = streams
        self._queue: asyncio.Queue[tuple[Any, BaseException | None]] = asyncio.Queue()
        self._tasks: list[asyncio.Task[None]] = []
        if len(streams) > 1:
            self._tasks = [asyncio.create_task(self._pump(s)) for s in streams]
        self._remaining = len(self._tasks)

    async def next(self) -> T:
        if len(self._streams) == 1:
            return await anext(self._streams[0])
        while self._remaining:
            item, err = await self._queue.get()
            if err is not None:
                raise err
            if item is not _DONE:
                return item  # type: ignore[no-any-return]
            self._remaining -= 1
        raise StopAsyncIteration

    async def aclose(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if len(self._streams) == 1:
            await self._streams[0].aclose()

    async def _pump(self, stream: AsyncGenerator[T, None]) -> None:
        try:
            async with aclosing(stream) as items:
                async for item in items:
                    self._queue.put_nowait((item, None))
        except Exception as err:  # noqa: BLE001 - handed to the consumer
            self._queue.put_nowait((_DONE, err))
            return
        self._queue.put_nowait((_DONE, None))


_DONE = object()  # a pump's end marker in the queue
