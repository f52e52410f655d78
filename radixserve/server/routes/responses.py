"""POST /v1/responses: the OpenAI Responses API (what the OpenAI Agents SDK calls by default).

Owns: the Response object (output items: an assistant `message` holding one `output_text`
part, then a `function_call` item per parsed tool call; status completed, or incomplete at
max_output_tokens), its usage shape, and the typed stream events (`response.created` ...
`response.completed`, numbered by sequence_number, each as `event: <type>` + `data:`), and
the text's logprobs when `include` asks (chat's logprobs entries, on the text part and on
each delta).
A request is turned into a chat request by radixserve/api/responses.py and runs exactly as
/v1/chat/completions runs it: the same template, tool grammar and call parser, and
response_format constraint. With `store` (the default) the finished Response and the
conversation it answered are kept (stored_responses.py); a response cut off before its end
(client gone, error) is not.
Does not know: the engine, how tokens are produced (ServerState, choice_stream.py).
"""

from __future__ import annotations

import enum
import itertools
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any

from aiohttp import web

from radixserve.api.jobs import ChoiceJob
from radixserve.api.protocol import parse_chat
from radixserve.api.responses import ResponsesEcho, parse_responses
from radixserve.api.tools.parsers import CallFormat
from radixserve.api.tools.stream import ChatToolStream, tool_message
from radixserve.server.app_state import ServerState, read_json, request_caller
from radixserve.server.choice_stream import ChoiceChunk
from radixserve.server.error_responses import json_response
from radixserve.server.routes.chat import chat_jobs
from radixserve.server.routes.openai import Usage, chat_logprobs, start_request
from radixserve.server.routes.stored_responses import (
    RESPONSE_ID_HEADER,
    add_stored_response_routes,
    history_for,
)
from radixserve.server.sse import write_sse
from radixserve.types import SamplingParams

LENGTH = "length"
TokenStr = Callable[[int], str]
OnDone = Callable[[dict[str, Any]], None]  # the finished Response (stores it)


class Status(str, enum.Enum):
    """A Response's (and an output item's) status, as OpenAI spells it."""

    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    INCOMPLETE = "incomplete"  # max_output_tokens cut it


def _status(finish: str | None, called: bool) -> Status:
    """As chat's finish_reason "tool_calls": a response that made calls is complete."""
    return Status.INCOMPLETE if finish == LENGTH and not called else Status.COMPLETED


def _usage(usage: Usage) -> dict[str, Any]:
    chat = usage.body()
    return {"input_tokens": chat["prompt_tokens"],
            "input_tokens_details": chat["prompt_tokens_details"],
            "output_tokens": chat["completion_tokens"],
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat["total_tokens"]}


def _text_part(text: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(text: str, status: Status, item_id: str | None = None,
                 logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    parts = [] if status is Status.IN_PROGRESS else [_text_part(text, logprobs)]
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex}",
            "status": status.value, "role": "assistant", "content": parts}


def call_item(call_id: str, name: str, arguments: str, status: Status,
              item_id: str | None = None) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id or f"fc_{uuid.uuid4().hex}",
            "call_id": call_id, "name": name, "arguments": arguments, "status": status.value}


class ResponseObject:
    """One response's id, creation time and echoed settings; `body` is the Response JSON."""

    def __init__(self, model: str, echo: ResponsesEcho, params: SamplingParams) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model, self.echo, self.params = model, echo, params

    def body(self, status: Status, output: list[dict[str, Any]],
             usage: dict[str, Any] | None) -> dict[str, Any]:
        e = self.echo
        incomplete = {"reason": "max_output_tokens"} if status is Status.INCOMPLETE else None
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status.value,
            "error": None, "incomplete_details": incomplete, "instructions": e.instructions,
            "max_output_tokens": e.max_output_tokens, "model": self.model, "output": output,
            "parallel_tool_calls": e.parallel_tool_calls,
            "previous_response_id": e.previous_response_id,
            "reasoning": {"effort": None, "summary": None}, "store": e.store,
            "temperature": self.params.temperature, "top_p": self.params.top_p,
            "text": e.text, "tool_choice": e.tool_choice, "tools": e.tools,
            "truncation": "disabled", "usage": usage, "user": e.user, "metadata": e.metadata,
        }


def _storer(state: ServerState, owner: str, items: list[dict[str, Any]]) -> OnDone:
    def store(body: dict[str, Any]) -> None:
        state.responses.put(owner, body, items)

    return store


async def responses(request: web.Request) -> web.StreamResponse:
    state, arrival = start_request(request)
    owner = request_caller(request).name
    parsed = parse_responses(await read_json(request), history_for(state.responses, owner))
    req = parse_chat(parsed.chat, state.call_format.name, state.check_constraint)
    jobs, calls = await chat_jobs(request, state, req, "input")
    response = ResponseObject(state.model_name, parsed.echo, jobs[0].params)
    on_done = _storer(state, owner, parsed.input_items) if parsed.echo.store else None
    headers = {RESPONSE_ID_HEADER: response.id} if on_done is not None else None
    with state.admit(request, jobs) as ticket:
        chunks = state.outputs(jobs, arrival, ticket, req.opts.timeout)
        if req.opts.stream:
            events = _events(response, jobs, chunks, calls, state.token_str, on_done)
            return await write_sse(request, events, named=True, headers=headers)
        body = await _collect(response, jobs, chunks, calls, state.token_str)
        if on_done is not None:
            on_done(body)
        return json_response(body, headers=headers)


async def _collect(response: ResponseObject, jobs: list[ChoiceJob],
                   chunks: AsyncGenerator[ChoiceChunk, None], calls: CallFormat | None,
                   token_str: TokenStr) -> dict[str, Any]:
    texts: list[str] = []
    lps: list[dict[str, Any]] = []
    finish: str | None = None
    usage = Usage(jobs)
    async with aclosing(chunks) as stream:
        async for c in stream:
            usage.add(c)
            texts.append(c.text)
            lps += _logprobs(token_str, c)
            finish = c.finish_reason or finish
    message: dict[str, Any] = {"content": "".join(texts)}
    called = False
    if calls is not None:
        message, called = tool_message(calls, message["content"])
    status = _status(finish, called)
    output = []
    tool_calls = message.get("tool_calls") or []
    if message["content"] or not tool_calls:
        output.append(message_item(message["content"], status, logprobs=lps))
    output += [call_item(tc["id"], tc["function"]["name"], tc["function"]["arguments"],
                         Status.COMPLETED) for tc in tool_calls]
    return response.body(status, output, _usage(usage))


class _EventStream:
    """The typed events of one streamed response: items opened as their first text or call
    delta arrives, each closed (its `.done` events) before the next one opens."""

    def __init__(self) -> None:
        self._seq = itertools.count()
        self.output: list[dict[str, Any]] = []  # finished items, in output_index order
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._text = ""  # its text, or its arguments so far
        self._lps: list[dict[str, Any]] = []  # its text's logprobs so far
        self.called = False  # a function_call item was opened

    @property
    def empty(self) -> bool:
        return not self.output and self._open is None

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": next(self._seq), **fields}

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.output)}

    def text(self, delta: str, lps: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        out = []
        if self._open is None or self._open["type"] != "message":
            out += self.close()
            self._open, self._text = message_item("", Status.IN_PROGRESS), ""
            self._lps = []
            out.append(self.event("response.output_item.added", output_index=len(self.output),
                                  item=self._open))
            out.append(self.event("response.content_part.added", **self._where(),
                                  content_index=0, part=_text_part("")))
        self._lps += lps or []
        if delta or lps:  # tokens with no text yet (a special token) still carry logprobs
            self._text += delta
            out.append(self.event("response.output_text.delta", **self._where(),
                                  content_index=0, delta=delta, logprobs=lps or []))
        return out

    def call(self, wire: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        args = wire["function"].get("arguments", "")
        if "id" in wire:  # a new call: its name and id come first
            out += self.close()
            self.called = True
            self._open = call_item(wire["id"], wire["function"]["name"], "", Status.IN_PROGRESS)
            self._text = ""
            out.append(self.event("response.output_item.added", output_index=len(self.output),
                                  item=self._open))
        if args:
            self._text += args
            out.append(self.event("response.function_call_arguments.delta", **self._where(),
                                  delta=args))
        return out

    def close(self, status: Status = Status.COMPLETED) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        out = []
        where = self._where()
        if item["type"] == "message":
            part = _text_part(self._text, self._lps)
            out.append(self.event("response.output_text.done", **where, content_index=0,
                                  text=self._text, logprobs=self._lps))
            out.append(self.event("response.content_part.done", **where, content_index=0,
                                  part=part))
            done = message_item(self._text, status, item["id"], self._lps)
        else:
            out.append(self.event("response.function_call_arguments.done", **where,
                                  arguments=self._text))
            done = call_item(item["call_id"], item["name"], self._text, Status.COMPLETED,
                             item["id"])
        out.append(self.event("response.output_item.done", output_index=where["output_index"],
                              item=done))
        self.output.append(done)
        self._open = None
        return out


def _logprobs(token_str: TokenStr, chunk: ChoiceChunk) -> list[dict[str, Any]]:
    """The chunk's tokens in the shape of chat's logprobs.content (empty when not asked)."""
    if not chunk.logprobs or all(lp is None for lp in chunk.logprobs):
        return []
    entries: list[dict[str, Any]] = chat_logprobs(token_str, chunk.token_ids,
                                                  chunk.logprobs)["content"]
    return entries


def _opening(out: _EventStream, response: ResponseObject) -> list[dict[str, Any]]:
    return [out.event(kind, response=response.body(Status.IN_PROGRESS, [], None))
            for kind in ("response.created", "response.in_progress")]


async def _events(response: ResponseObject, jobs: list[ChoiceJob],
                  chunks: AsyncGenerator[ChoiceChunk, None], calls: CallFormat | None,
                  token_str: TokenStr, on_done: OnDone | None = None
                  ) -> AsyncGenerator[dict[str, Any], None]:
    out = _EventStream()
    usage = Usage(jobs)
    tools = ChatToolStream(calls) if calls else None
    finish: str | None = None
    started = False
    async with aclosing(chunks) as stream:
        async for c in stream:
            if not started:  # after the first output: a request the engine rejects is a 4xx
                started = True
                for event in _opening(out, response):
                    yield event
            usage.add(c)
            finish = c.finish_reason or finish
            final = c.finish_reason is not None
            if tools is None:  # plain text (logprobs are only served without tools)
                for event in out.text(c.text, _logprobs(token_str, c)):
                    yield event
                continue
            for delta in tools.deltas(c.text, final):
                events = (out.text(delta["content"]) if delta.get("content")
                          else [e for w in delta.get("tool_calls", []) for e in out.call(w)])
                for event in events:
                    yield event
    for event in [] if started else _opening(out, response):
        yield event
    status = _status(finish, out.called)
    if out.empty:  # nothing was generated: still one (empty) message
        for event in out.text(""):
            yield event
    for event in out.close(status):
        yield event
    body = response.body(status, out.output, _usage(usage))
    if on_done is not None:  # before the last event: a client chaining at once finds it
        on_done(body)
    yield out.event(f"response.{status.value}", response=body)


def add_responses_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", responses)
    add_stored_response_routes(app)
