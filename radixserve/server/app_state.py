"""ServerState: what one app's handlers share between parsing a request and streaming it.

Owns: readiness (and draining: the one "shutting down" 503), loading the model's facts from
the engine, the model-name check, the caps requests are sized under (the sizing itself,
prompts x n into ChoiceJobs: radixserve/api/jobs.py), admission with per-key accounting, the
request deadline, the opt-in request log line, and the request keys (STATE_KEY,
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
from typing import Any

from aiohttp import web

from radixserve.api.api_keys import KeyLimits
from radixserve.api.constraints.check import ConstraintChecker
from radixserve.api.jobs import ChoiceJob, JobCaps, MergedStreams, make_jobs, tightest
from radixserve.api.protocol import PromptInput, RequestOptions
from radixserve.api.reasoning import ReasoningFormat, get_reasoning_format
from radixserve.api.response_store import ResponseStore
from radixserve.api.tools.parsers import get_format
from radixserve.api.tools.prompt import supports_tools
from radixserve.api.tools.tool_fields import ToolsSpec
from radixserve.config import ServerConfig
from radixserve.ipc.client import EngineClient, EngineState
from radixserve.server import prompts
from radixserve.server.access.auth import ANONYMOUS_CALLER, ApiKeys, Caller
from radixserve.server.access.body import read_json as read_json  # re-exported for routes
from radixserve.server.access.deadline import deadline_at, timeout_error
from radixserve.server.access.limits import Admission, Ticket
from radixserve.server.access.middleware import CALLER_FIELD
from radixserve.server.choice_stream import ChoiceChunk, stream_choice
from radixserve.server.error_responses import APIError
from radixserve.server.metrics import ServerMetrics
from radixserve.types import TemplateOptions

LOG_PREVIEW_CHARS = 8  # --log-requests shows this much of a prompt, never more

request_logger = logging.getLogger("radixserve.requests")


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
        self.reasoning_format: ReasoningFormat | None = (
            None if cfg.reasoning_parser is None else get_reasoning_format(cfg.reasoning_parser))
        self.native_tools = False  # the chat template renders tools itself (set on load)
        # schemas that passed, remembered; closed as the engine closes them (grammar_text.py)
        self.check_constraint = ConstraintChecker(
            allow_additional_properties=cfg.engine.structured_outputs_allow_additional_properties)
        self._token_strs: dict[int, str] = {}
        self.responses = ResponseStore(cfg.responses_store_size)  # /v1/responses, store: true
        # LoRA adapters a request may name in `model`: name -> PEFT folder (--lora-modules,
        # then /v1/load_lora_adapter and /v1/unload_lora_adapter); the engine reads them.
        lora = cfg.engine.lora
        self.loras: dict[str, str] = {} if lora is None else {m.name: m.path
                                                              for m in lora.modules}
        # vLLM's /v1/models `parent` of an adapter given with a JSON `base_model_name`
        self.lora_parents: dict[str, str] = {} if lora is None else {
            m.name: m.base_model_name for m in lora.modules if m.base_model_name}

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

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter `model` names (None: the base model); 404 for an unknown name."""
        if name is None or name in (self.model_name, self.cfg.engine.model):
            return None
        if name in self.loras:
            return name
        raise APIError(404, f"The model `{name}` does not exist; this server serves "
                            f"'{self.model_name}'"
                            + (f" and the LoRA adapters {sorted(self.loras)}" if self.loras
                               else ""), param="model", code="model_not_found")

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
        jobs = self.make_jobs(prompts, opts, caller.cache_salt, param, caller.limits)
        lora = self.check_model(opts.model)
        return jobs if lora is None else [dataclasses.replace(j, lora_name=lora) for j in jobs]

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

    async def outputs(self, jobs: Sequence[ChoiceJob], arrival: float, ticket: Ticket,
                      timeout: float | None) -> AsyncGenerator[ChoiceChunk, None]:
        """An admitted request's choices as one stream: displaceable until its first output
        (a full queue may give its place to a more important request: 429), cut off at its
        deadline (the server's --request-timeout or the request's own `timeout`, whichever is
        sooner, counted from arrival: 408), the tokens it used counted as they arrive.
        Leaving it (cut off, displaced, or the consumer gone) closes every choice, which
        aborts their engine requests, so their pages are freed.

        NOTE: one generator, not one per concern: merging, displacement, the deadline and
        the counting are plain calls per output (tests/server/test_token_path.py bounds the
        generators a token passes through)."""
        limit = tightest(self.cfg.request_timeout, timeout)
        at = deadline_at(limit, arrival)
        streams = [self.stream(j, arrival) for j in jobs]
        started: set[int] = set()  # choices whose prompt tokens are counted
        async with aclosing(MergedStreams(streams)) as merged:
            while True:
                try:
                    async with asyncio.timeout_at(at) as window:
                        ticket.wait_in(window)
                        chunk = await merged.next()
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    if not window.expired():
                        raise
                    raise self._cut_off(ticket, limit) from None
                finally:
                    ticket.wait_in(None)
                ticket.output_arrived()
                self._count(ticket, jobs[chunk.index], chunk, started)
                yield chunk

    def _cut_off(self, ticket: Ticket, limit: float | None) -> APIError:
        """What an expired wait means: displaced (429), or past the deadline (408)."""
        displaced = ticket.timeout_error()
        if displaced is not None:
            return displaced
        assert limit is not None, "only a displacement or a deadline expires the wait"
        self.metrics.request_timeouts.inc()
        return timeout_error(limit)

    def _count(self, ticket: Ticket, job: ChoiceJob, chunk: ChoiceChunk,
               started: set[int]) -> None:
        """The tokens a choice really used, for tpm reconciliation and /metrics."""
        if job.index not in started:
            started.add(job.index)
            ticket.used_tokens += len(job.prompt_ids)
        ticket.used_tokens += len(chunk.token_ids)
        name = ticket.caller.name or "anonymous"
        self.metrics.key_generation_tokens.labels(name).inc(len(chunk.token_ids))

    def stream(self, job: ChoiceJob, arrival: float) -> AsyncGenerator[ChoiceChunk, None]:
        return stream_choice(self.client, self.tokenizer, job, self.eos_ids, self.metrics,
                             arrival)

    def token_str(self, token_id: int) -> str:
        text = self._token_strs.get(token_id)
        if text is None:
            text = str(self.tokenizer.decode([token_id]))
            self._token_strs[token_id] = text
        return text


STATE_KEY: web.AppKey[ServerState] = web.AppKey("radixserve_state", ServerState)
# The prompt's text (or its first characters), kept for --log-requests' preview only.
PREVIEW_FIELD: web.RequestKey[str] = web.RequestKey("radixserve_prompt_preview", str)


def request_caller(request: web.Request) -> Caller:
    caller: Caller = request.get(CALLER_FIELD, ANONYMOUS_CALLER)
    return caller
