"""OpenAI routes: POST /v1/completions, GET /v1/models, and the pieces chat.py shares.

Owns: OpenAI's wire format for completions (responses, stream chunks), usage, both logprobs
shapes. Does not know: how tokens are produced (ServerState and choice_stream.py do that),
chat messages and their tool calls and reasoning (chat.py).
"""

from __future__ import annotations

import dataclasses
import enum
import time
import uuid
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any

from aiohttp import web

from radixserve.api.jobs import ChoiceJob
from radixserve.api.protocol import parse_completion
from radixserve.server.app_state import PREVIEW_FIELD, STATE_KEY, ServerState, read_json
from radixserve.server.choice_stream import ChoiceChunk
from radixserve.server.error_responses import json_response
from radixserve.server.sse import write_sse
from radixserve.types import TokenLogprobs


class ResponseObject(enum.Enum):
    """OpenAI's `object` of a response or a stream chunk, with its id's prefix."""

    COMPLETION = ("cmpl", "text_completion")  # whole and streamed alike
    CHAT = ("chatcmpl", "chat.completion")
    CHAT_CHUNK = ("chatcmpl", "chat.completion.chunk")


def response_base(state: ServerState, jobs: list[ChoiceJob],
                  kind: ResponseObject) -> dict[str, Any]:
    """The fields every response and chunk of one request starts with: a fresh id, `object`,
    `created`, and `model` (the LoRA adapter's name where the request named one)."""
    prefix, obj = kind.value
    return {"id": f"{prefix}-{uuid.uuid4().hex}", "object": obj, "created": int(time.time()),
            "model": jobs[0].lora_name or state.model_name}


class Usage:
    """prompt_tokens counts each prompt once (not once per choice, as OpenAI); cached_tokens is,
    per prompt, the smallest cache hit among its choices."""

    def __init__(self, jobs: list[ChoiceJob]) -> None:
        self._prompt_len = {j.prompt_index: len(j.prompt_ids) for j in jobs}
        self._prompt_of = {j.index: j.prompt_index for j in jobs}
        self._cached: dict[int, int] = {}
        self.completion_tokens = 0
        self._predicted = any(j.prediction_ids for j in jobs)
        self._drafts: dict[int, tuple[int, int]] = {}  # choice -> (drafted, accepted)

    def add(self, chunk: ChoiceChunk) -> None:
        self.completion_tokens += len(chunk.token_ids)
        if chunk.num_draft_tokens:
            self._drafts[chunk.index] = (chunk.num_draft_tokens, chunk.num_accepted_draft_tokens)
        if chunk.token_ids:
            p = self._prompt_of[chunk.index]
            self._cached[p] = min(self._cached.get(p, chunk.num_cached_tokens),
                                  chunk.num_cached_tokens)

    def body(self) -> dict[str, Any]:
        prompt = sum(self._prompt_len.values())
        body = {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": sum(self._cached.values())}}
        if self._predicted or self._drafts:
            # OpenAI's Predicted Outputs counts; here over every draft verified (the
            # prediction's, and the server's own sources under --speculative-config).
            drafted = sum(d for d, _ in self._drafts.values())
            accepted = sum(a for _, a in self._drafts.values())
            body["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                                 "rejected_prediction_tokens": drafted - accepted}
        return body


class CompletionLogprobs:
    """The legacy completions shape; text_offset runs across the chunks of one choice."""

    def __init__(self, token_str: Callable[[int], str], start_offset: int) -> None:
        self._token_str = token_str
        self._offset = start_offset

    def format(self, token_ids: list[int], lps: list[TokenLogprobs | None]) -> dict[str, Any]:
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                     "text_offset": []}
        for token_id, lp in zip(token_ids, lps, strict=True):
            text = self._token_str(token_id)
            out["tokens"].append(text)
            out["token_logprobs"].append(None if lp is None else lp.token_logprob)
            out["top_logprobs"].append(
                None if lp is None else {self._token_str(t): v for t, v in lp.top})
            out["text_offset"].append(self._offset)
            self._offset += len(text)
        return out


def chat_logprobs(token_str: Callable[[int], str], token_ids: list[int],
                  lps: list[TokenLogprobs | None]) -> dict[str, Any]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_str(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    content = []
    for token_id, lp in zip(token_ids, lps, strict=True):
        if lp is not None:
            item = entry(token_id, lp.token_logprob)
            item["top_logprobs"] = [entry(t, v) for t, v in lp.top]
            content.append(item)
    return {"content": content}


def start_request(request: web.Request) -> tuple[ServerState, float]:
    """The server state (503 unless ready) and the request's arrival time."""
    state = request.app[STATE_KEY]
    state.ensure_ready()
    return state, time.perf_counter()


async def completions(request: web.Request) -> web.StreamResponse:
    state, arrival = start_request(request)
    req = parse_completion(await read_json(request), state.check_constraint)
    state.check_model(req.opts.model)
    prompts = [await state.encode(p) for p in req.prompts]
    if isinstance(req.prompts[0], str):
        request[PREVIEW_FIELD] = req.prompts[0]
    jobs = await with_prediction(state, state.caller_jobs(request, prompts, req.opts, "prompt"),
                                 req.opts.prediction)
    echo = None
    if req.echo:
        echo = [p if isinstance(p, str) else state.tokenizer.decode(list(p)) for p in req.prompts]
    want_lp = req.opts.params.logprobs is not None
    with state.admit(request, jobs) as ticket:
        chunks = state.outputs(jobs, arrival, ticket, req.opts.timeout)
        # Not streamed: the usage event (always the last) is the response's usage.
        usage = req.opts.include_usage or not req.opts.stream
        events = _completion_events(state, jobs, chunks, echo, want_lp,
                                    req.opts.return_token_ids, usage)
        if req.opts.stream:
            return await write_sse(request, events)
        return json_response(await _collect_completion(events, len(jobs)))


async def _completion_events(state: ServerState, jobs: list[ChoiceJob],
                             chunks: AsyncGenerator[ChoiceChunk, None], echo: list[str] | None,
                             want_lp: bool, ids: bool = False, with_usage: bool = True
                             ) -> AsyncGenerator[dict[str, Any], None]:
    """Completion chunks, then (`with_usage`) a last event with no choices and the usage."""
    base = response_base(state, jobs, ResponseObject.COMPLETION)
    usage = Usage(jobs)
    lp_builders: dict[int, CompletionLogprobs] = {}
    async with aclosing(chunks) as stream:
        async for c in stream:
            usage.add(c)
            text, first = c.text, c.index not in lp_builders
            if first:
                prefix = echo[jobs[c.index].prompt_index] if echo else ""
                lp_builders[c.index] = CompletionLogprobs(state.token_str, len(prefix))
                text = prefix + text
            lp = lp_builders[c.index].format(c.token_ids, c.logprobs) if want_lp else None
            if text or c.finish_reason or lp or (ids and (first or c.token_ids)):
                choice = {"index": c.index, "text": text, "logprobs": lp,
                          "finish_reason": c.finish_reason}
                if ids:
                    _add_token_ids(choice, c, jobs[c.index] if first else None)
                yield {**base, "choices": [choice]}
    if with_usage:
        yield {**base, "choices": [], "usage": usage.body()}


async def _collect_completion(events: AsyncGenerator[dict[str, Any], None],
                              num_choices: int) -> dict[str, Any]:
    """The streamed events folded into one response; with return_token_ids each choice holds
    its `prompt_token_ids` and all its `token_ids` (vLLM's non-streaming placement)."""
    choices: list[dict[str, Any]] = [
        {"index": i, "text": "", "logprobs": None, "finish_reason": None}
        for i in range(num_choices)]
    last: dict[str, Any] = {}
    async with aclosing(events) as stream:
        async for event in stream:
            last = event
            for part in event["choices"]:
                choice = choices[part["index"]]
                choice["text"] += part["text"]
                choice["finish_reason"] = part["finish_reason"]
                if "prompt_token_ids" in part:
                    choice["prompt_token_ids"] = part["prompt_token_ids"]
                if "token_ids" in part:
                    choice.setdefault("token_ids", []).extend(part["token_ids"])
                if part["logprobs"] is not None:
                    if choice["logprobs"] is None:
                        choice["logprobs"] = {k: [] for k in part["logprobs"]}
                    lp = choice["logprobs"]
                    for k, values in part["logprobs"].items():
                        lp[k].extend(values)
    return {**last, "choices": choices}


def _add_token_ids(choice: dict[str, Any], c: ChoiceChunk, first_of: ChoiceJob | None) -> None:
    """return_token_ids: this chunk's tokens (all of them: a chunk is emitted for tokens whose
    text is held back too), and the prompt's on a choice's first chunk."""
    choice["token_ids"] = list(c.token_ids)
    if first_of is not None:
        choice["prompt_token_ids"] = list(first_of.prompt_ids)


async def with_prediction(state: ServerState, jobs: list[ChoiceJob],
                          text: str | None) -> list[ChoiceJob]:
    """Every choice drafts from the request's `prediction` (tokenized as output text)."""
    if not text:
        return jobs
    ids = tuple(await state.encode(text, add_special_tokens=False))
    return [dataclasses.replace(j, prediction_ids=ids) for j in jobs]


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    card = {"id": state.model_name, "object": "model", "created": int(state.started),
            "owned_by": "radixserve", "root": state.cfg.engine.model,
            "max_model_len": state.max_model_len or None}
    # vLLM's shape: each LoRA adapter is a model whose `parent` is the base model's id (or
    # the `base_model_name` its --lora-modules JSON gave).
    adapters = [{"id": name, "object": "model", "created": int(state.started),
                 "owned_by": "radixserve", "root": path,
                 "parent": state.lora_parents.get(name, state.model_name),
                 "max_model_len": state.max_model_len or None}
                for name, path in state.loras.items()]
    return json_response({"object": "list", "data": [card, *adapters]})


def add_openai_routes(app: web.Application) -> None:
    app.router.add_post("/v1/completions", completions)
    app.router.add_get("/v1/models", list_models)
