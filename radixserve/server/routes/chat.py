"""OpenAI chat route: POST /v1/chat/completions, streamed or whole.

Owns: the chat wire format (`message`, `delta` chunks, vLLM's `return_token_ids` placement)
and, per request, how its output is read back (tool calls, reasoning: api/chat_output.py).
Does not know: how tokens are produced (ServerState and choice_stream.py), message parsing.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from aiohttp import web

from radixserve.api.chat_output import ChoiceReader, OutputReading, chat_message, finish_of
from radixserve.api.jobs import ChoiceJob
from radixserve.api.protocol import ChatRequest, parse_chat
from radixserve.api.reasoning import prompt_opens_thinking, thinking_enabled
from radixserve.api.tools.parsers import CallFormat
from radixserve.server.app_state import PREVIEW_FIELD, ServerState, read_json
from radixserve.server.choice_stream import ChoiceChunk
from radixserve.server.error_responses import json_response
from radixserve.server.routes.openai import (
    ResponseObject,
    Usage,
    chat_logprobs,
    response_base,
    start_request,
    with_prediction,
)
from radixserve.server.sse import write_sse

# Tokens of the prompt's end decoded to see whether the template left <think> open: the
# generation prompt is a few tokens ("<|im_start|>assistant\n<think>\n").
_PROMPT_TAIL_TOKENS = 32


async def chat_completions(request: web.Request) -> web.StreamResponse:
    state, arrival = start_request(request)
    req = parse_chat(await read_json(request), state.call_format.name, state.check_constraint)
    jobs, calls = await chat_jobs(request, state, req, "messages")
    reading = output_reading(state, req, jobs, calls)
    ids = req.opts.return_token_ids
    with state.admit(request, jobs) as ticket:
        chunks = state.outputs(jobs, arrival, ticket, req.opts.timeout)
        if req.opts.stream:
            events = _chat_events(state, jobs, chunks, req.opts.params.logprobs is not None,
                                  reading, ids, req.opts.include_usage)
            return await write_sse(request, events)
        return json_response(await _collect_chat(state, jobs, chunks, reading, ids))


async def chat_jobs(request: web.Request, state: ServerState, req: ChatRequest,
                    param: str) -> tuple[list[ChoiceJob], CallFormat | None]:
    """A parsed chat request's choices (its prompt rendered, the caller's limits applied;
    `param` names the prompt's field in errors) and the call format its output is read back
    with: tool calls unless tool_choice is "none" (or there are no tools)."""
    state.check_model(req.opts.model)
    prompt = await state.encode_messages(req.messages, req.tools, req.template)
    request[PREVIEW_FIELD] = req.messages[-1]["content"]
    jobs = await with_prediction(state, state.caller_jobs(request, [prompt], req.opts, param),
                                 req.opts.prediction)
    calls = state.call_format if req.tools is not None and req.tools.parses_calls else None
    return jobs, calls


def output_reading(state: ServerState, req: ChatRequest, jobs: list[ChoiceJob],
                   calls: CallFormat | None) -> OutputReading:
    """The server's --reasoning-parser unless the request turned thinking off; whether the
    rendered prompt already opened the thinking block (every choice shares the prompt)."""
    fmt = state.reasoning_format
    if fmt is None:
        return OutputReading(calls)
    if not thinking_enabled(req.template.kwargs):
        return OutputReading(calls, reasoning_field=True)
    tail = state.tokenizer.decode(list(jobs[0].prompt_ids[-_PROMPT_TAIL_TOKENS:]),
                                  skip_special_tokens=False)
    return OutputReading(calls, fmt, prompt_opens_thinking(tail), reasoning_field=True)


async def _chat_events(state: ServerState, jobs: list[ChoiceJob],
                       chunks: AsyncGenerator[ChoiceChunk, None], want_lp: bool,
                       reading: OutputReading, ids: bool = False, with_usage: bool = False
                       ) -> AsyncGenerator[dict[str, Any], None]:
    """Chat completion chunks, then (`with_usage`: stream_options.include_usage) a last event
    with no choices and the usage. return_token_ids: the prompt's ids on a choice's first
    chunk (on the choice, which the router reads, and on the chunk, as vLLM), then each
    chunk's generated ids."""
    base = response_base(state, jobs, ResponseObject.CHAT_CHUNK)
    usage = Usage(jobs)
    readers: dict[int, ChoiceReader] = {}
    async with aclosing(chunks) as stream:
        async for c in stream:
            usage.add(c)
            if c.index not in readers:  # OpenAI: the first chunk of a choice carries the role
                readers[c.index] = ChoiceReader(reading)
                role: dict[str, Any] = {"index": c.index, "logprobs": None, "finish_reason": None,
                                        "delta": {"role": "assistant", "content": ""}}
                first = {**base, "choices": [role]}
                if ids:
                    role["prompt_token_ids"] = list(jobs[c.index].prompt_ids)
                    first["prompt_token_ids"] = role["prompt_token_ids"]
                yield first
            lp = chat_logprobs(state.token_str, c.token_ids, c.logprobs) if want_lp else None
            reader = readers[c.index]
            deltas = reader.deltas(c.text, c.finish_reason is not None)
            finish = reader.finish_reason(c.finish_reason)
            if finish or (lp and lp["content"]) or (ids and c.token_ids):
                deltas = deltas or [{}]  # one chunk carries the finish / logprobs / token ids
            for k, delta in enumerate(deltas):
                last = k == len(deltas) - 1
                choice = {"index": c.index, "delta": delta, "logprobs": lp if k == 0 else None,
                          "finish_reason": finish if last else None}
                if ids:
                    choice["token_ids"] = list(c.token_ids) if k == 0 else []
                yield {**base, "choices": [choice]}
    if with_usage:
        yield {**base, "choices": [], "usage": usage.body()}


async def _collect_chat(state: ServerState, jobs: list[ChoiceJob],
                        chunks: AsyncGenerator[ChoiceChunk, None], reading: OutputReading,
                        ids: bool = False) -> dict[str, Any]:
    """The whole response; return_token_ids: each choice's `token_ids` and the response's
    `prompt_token_ids` (vLLM's non-streaming placement)."""
    want_lp = jobs[0].params.logprobs is not None
    texts: list[list[str]] = [[] for _ in jobs]
    token_ids: list[list[int]] = [[] for _ in jobs]
    lps: list[list[Any]] = [[] for _ in jobs]
    finish: list[str | None] = [None] * len(jobs)
    usage = Usage(jobs)
    async with aclosing(chunks) as stream:
        async for c in stream:
            usage.add(c)
            texts[c.index].append(c.text)
            token_ids[c.index].extend(c.token_ids)
            finish[c.index] = c.finish_reason or finish[c.index]
            if want_lp:
                lp = chat_logprobs(state.token_str, c.token_ids, c.logprobs)
                lps[c.index].extend(lp["content"])
    choices = []
    for i in range(len(jobs)):
        message, called = chat_message(reading, "".join(texts[i]))
        choice = {"index": i, "message": message,
                  "logprobs": {"content": lps[i]} if want_lp else None,
                  "finish_reason": finish_of(called, finish[i])}
        if ids:
            choice["token_ids"] = token_ids[i]
        choices.append(choice)
    body = {**response_base(state, jobs, ResponseObject.CHAT), "choices": choices,
            "usage": usage.body()}
    if ids:
        body["prompt_token_ids"] = list(jobs[0].prompt_ids)
    return body


def add_chat_routes(app: web.Application) -> None:
    app.router.add_post("/v1/chat/completions", chat_completions)
