"""ServerState: what one app's handlers share between parsing a request and streaming it.

Owns: readiness (and draining: the one "shutting down" 503), loading the model's facts from
the engine, the model-name check, the caps requests are sized under (the sizing itself,
prompts x n into ChoiceJobs: radixserve/api/jobs.py), admission with per-key accounting, the
request deadline, the opt-in request log line, and the request keys (STATE_KEY, CALLER_FIELD,
PREVIEW_FIELD). Tokenization is server/prompts.py's. Does not know: OpenAI's wire format.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, Iterator, Sequence
from contextlib import aclosing, contextmanager
from pathlib import Path
from typing import Any, TypeVar

from aiohttp import web

from radixserve.api.api_keys import KeyLimits
from radixserve.api.constraints.check import ConstraintChecker
from radixserve.api.jobs import ChoiceJob, JobCaps, make_jobs, merge_streams, tightest
from radixserve.api.protocol import PromptInput, RequestOptions
from radixserve.api.response_store import ResponseStore
from radixserve.api.tools.parsers import get_format
from radixserve.api.tools.prompt import supports_tools
from radixserve.api.tools.tool_fields import ToolsSpec
from radixserve.config import ServerConfig
from radixserve.ipc.client import EngineClient, EngineState
from radixserve.server import prompts
from radixserve.server.access.auth import ANONYMOUS_CALLER, ApiKeys, Caller
from radixserve.server.access.body import read_json as read_json  # re-exported for routes
from radixserve.server.access.deadline import deadline_events
from radixserve.server.access.limits import Admission, Ticket, displaceable
from radixserve.server.choice_stream import ChoiceChunk, stream_choice
from radixserve.server.error_responses import APIError
from radixserve.server.metrics import ServerMetrics
from radixserve.types import TemplateOptions

LOG_PREVIEW_CHARS = 8  # --log-requests shows this much of a prompt, never more

request_logger = logging.getLogger("radixserve.requests")
T = TypeVar("T")


class ServerState:
    def __init__(self, cfg: ServerConfig, client: EngineClient) -> None:
        self.cfg = cfg
        self.client = client
        # The admin key authenticates too (admin routes check Caller.admin), when keys are on.
        keyed = bool(cfg.api_keys or cfg.api_keys_file)
        self.auth = ApiKeys(cfg.api_keys, cfg.shared_cache, cfg.api_keys_file,
                            admin_key=cfg.admin_key if keyed else None)
        self.metrics = ServerMetrics(lambda: self.client.stats, self.auth.salt_name)
        self.admission = Admission(cfg.max_concurrent_per_key, cfg.max_queue,
                                   on_refused=self._count_refused,
                                   on_displaced=self._count_displaced)
        self.draining = False  # SIGTERM: new requests get 503, in-flight ones finish
        self.started = time.time()
        self.tokenizer: Any = None
        self.model_name = cfg.served_model_name or cfg.engine.model
        self.max_model_len = 0
        self.vocab_size = 0
        self.eos_ids: tuple[int, ...] = ()
        self.call_format = get_format(cfg.tool_call_parser)
        self.native_tools = False  # the chat template renders tools itself (set on load)
        # schemas that passed, remembered; closed as the engine closes them (grammar_text.py)
        self.check_constraint = ConstraintChecker(
            allow_additional_properties=cfg.engine.structured_outputs_allow_additional_properties)
        self._token_strs: dict[int, str] = {}
        self.responses = ResponseStore(cfg.responses_store_size)  # /v1/responses, store: true

    @property
    def ready(self) -> bool:
        return self.tokenizer is not None and self.client.state is EngineState.READY

    async def load(self) -> None:
        """Start the engine, then load the tokenizer from the folder it resolved."""
        loop = asyncio.get_running_loop()
        # An HF folder holds the tokenizer: load it while the engine loads the weights.
        guess = Path(self.cfg.engine.model)
        early = None
        if (guess / "tokenizer_config.json").is_file():
            early = loop.run_in_executor(None, prompts.load_tokenizer, guess)
        info = await self.client.start()
        path = Path(info["model_path"])
        if early is not None and path.resolve() == guess.resolve():
            self.tokenizer = await early
        else:
            if early is not None:  # a wrong guess: retire it (and any error it raised)
                await asyncio.gather(early, return_exceptions=True)
            self.tokenizer = await loop.run_in_executor(None, prompts.load_tokenizer, path)
        self.model_name = self.cfg.served_model_name or info.get("model") or self.model_name
        self.max_model_len = int(info["max_model_len"])
        self.vocab_size = int(info.get("vocab_size") or len(self.tokenizer))
        self.eos_ids = tuple(info.get("eos_token_ids") or ())
        self.native_tools = supports_tools(getattr(self.tokenizer, "chat_template", None))

    def _count_refused(self, key_name: str, code: str) -> None:
        self.metrics.key_refused.labels(key_name or "anonymous", code).inc()

    def _count_displaced(self, ticket: Ticket) -> None:
        self.metrics.requests_displaced.labels(ticket.caller.name or "anonymous").inc()

    def refuse_if_draining(self) -> None:
        """After SIGTERM: new requests get 503 (with Retry-After), in-flight ones finish."""
        if self.draining:
            raise APIError(503, "the server is shutting down", code="draining",
                           headers={"Retry-After": "1"})

    def ensure_ready(self) -> None:
        self.refuse_if_draining()
        if self.client.state is EngineState.DEAD:
            raise APIError(503, f"the engine is dead: {self.client.error}", code="engine_dead")
        if not self.ready:
            raise APIError(503, "the model is still loading", code="model_loading")

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model_name, self.cfg.engine.model):
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"'{self.model_name}'", param="model", code="model_not_found")

    async def encode(self, prompt: PromptInput, add_special_tokens: bool = True) -> list[int]:
        return await prompts.encode_prompt(self.tokenizer, self.vocab_size, prompt,
                                           add_special_tokens)

    async def encode_messages(self, messages: Sequence[dict[str, Any]],
                              tools: ToolsSpec | None = None,
                              template: TemplateOptions | None = None) -> list[int]:
        return await prompts.encode_messages(self.tokenizer, messages, tools, self.call_format,
                                             self.native_tools, template or TemplateOptions())

    @property
    def caps(self) -> JobCaps:
        """The bounds requests are sized under (the model's are known once it loaded)."""
        return JobCaps(self.max_model_len, self.vocab_size, self.cfg.max_tokens_cap,
                       self.cfg.max_input_tokens)

    def make_jobs(self, prompts: Sequence[list[int]], opts: RequestOptions, salt: str,
                  param: str, limits: KeyLimits = ANONYMOUS_CALLER.limits) -> list[ChoiceJob]:
        """api/jobs.make_jobs under this server's caps: prompts x n choices."""
        return make_jobs(self.caps, prompts, opts, salt, param, limits)

    def caller_jobs(self, request: web.Request, prompts: Sequence[list[int]],
                    opts: RequestOptions, param: str) -> list[ChoiceJob]:
        """make_jobs under the caller's cache namespace, per-key caps and priority."""
        caller = request_caller(request)
        opts = dataclasses.replace(opts, priority=caller.priority_for(opts.priority))
        return self.make_jobs(prompts, opts, caller.cache_salt, param, caller.limits)

    @contextmanager
    def admit(self, request: web.Request, jobs: Sequence[ChoiceJob]) -> Iterator[Ticket]:
        """Admission for one HTTP request (raises APIError 429); counts it per key."""
        self.refuse_if_draining()
        caller = request_caller(request)
        charged = sum(len(j.prompt_ids) + (j.params.max_tokens or 0) for j in jobs)
        priority = jobs[0].priority if jobs else 0  # the same for every choice
        with self.admission.admit(caller, len(jobs), charged, priority) as ticket:
            name = caller.name or "anonymous"
            self.metrics.key_requests.labels(name).inc()
            self.metrics.key_prompt_tokens.labels(name).inc(
                sum(len(j.prompt_ids) for j in jobs))
            if self.cfg.log_requests:
                self._log_request(request, caller, jobs)
            yield ticket

    def _log_request(self, request: web.Request, caller: Caller,
                     jobs: Sequence[ChoiceJob]) -> None:
        """One line per request; no prompt text (only its first few characters), no key."""
        preview = request.get(PREVIEW_FIELD, "")
        shown = preview[:LOG_PREVIEW_CHARS] + ("..." if len(preview) > LOG_PREVIEW_CHARS else "")
        request_logger.info(
            "request %s %s key=%s choices=%d prompt_tokens=%s max_tokens=%s prompt=%r "
            "(%d chars)", request.method, request.path, caller.name or "-", len(jobs),
            [len(j.prompt_ids) for j in jobs][:4], jobs[0].params.max_tokens if jobs else None,
            shown, len(preview))

    def outputs(self, jobs: Sequence[ChoiceJob], arrival: float, ticket: Ticket,
                timeout: float | None) -> AsyncGenerator[ChoiceChunk, None]:
        """An admitted request's choices as one stream: displaceable until its first output
        (a full queue may give its place to a more important request: 429), cut off at its
        deadline."""
        merged = merge_streams([self.stream(j, arrival, ticket) for j in jobs])
        return self.with_deadline(displaceable(merged, ticket), arrival, timeout)

    def stream(self, job: ChoiceJob, arrival: float,
               ticket: Ticket | None = None) -> AsyncGenerator[ChoiceChunk, None]:
        chunks = stream_choice(self.client, self.tokenizer, job, self.eos_ids, self.metrics,
                               arrival)
        return chunks if ticket is None else self._counted(chunks, job, ticket)

    async def _counted(self, chunks: AsyncGenerator[ChoiceChunk, None], job: ChoiceJob,
                       ticket: Ticket) -> AsyncGenerator[ChoiceChunk, None]:
        """Count the tokens a choice really used, for tpm reconciliation and /metrics."""
        counter = self.metrics.key_generation_tokens.labels(ticket.caller.name or "anonymous")
        first = True
        async with aclosing(chunks) as stream:
            async for chunk in stream:
                if first:
                    ticket.used_tokens += len(job.prompt_ids)
                    first = False
                ticket.used_tokens += len(chunk.token_ids)
                counter.inc(len(chunk.token_ids))
                yield chunk

    def with_deadline(self, events: AsyncGenerator[T, None], arrival: float,
                      timeout: float | None) -> AsyncGenerator[T, None]:
        """`events`, cut off (aborting the engine work: its pages are freed) at the deadline:
        the server's --request-timeout or the request's own `timeout`, whichever is sooner,
        counted from arrival. Past it the caller sees APIError(408)."""
        limit = tightest(self.cfg.request_timeout, timeout)
        if limit is None:
            return events
        return deadline_events(events, limit - (time.perf_counter() - arrival), limit,
                         self.metrics.request_timeouts.inc)

    def token_str(self, token_id: int) -> str:
        text = self._token_strs.get(token_id)
        if text is None:
            text = str(self.tokenizer.decode([token_id]))
            self._token_strs[token_id] = text
        return text


STATE_KEY: web.AppKey[ServerState] = web.AppKey("radixserve_state", ServerState)
# The caller, set on each request by the auth middleware.
CALLER_FIELD: web.RequestKey[Caller] = web.RequestKey("radixserve_caller", Caller)
# The prompt's text (or its first characters), kept for --log-requests' preview only.
PREVIEW_FIELD: web.RequestKey[str] = web.RequestKey("radixserve_prompt_preview", str)


def request_caller(request: web.Request) -> Caller:
    caller: Caller = request.get(CALLER_FIELD, ANONYMOUS_CALLER)
    return caller
