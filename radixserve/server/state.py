"""Per-app serving state: the engine client, the tokenizer, limits, and prompt preparation.

Owns: what a handler needs between parsing and streaming: readiness, the model-name check,
tokenization (off the event loop for long inputs), input/context/cap checks, resolving
max_tokens, and turning prompts x n into ChoiceJobs. Does not know: OpenAI's wire format.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from radixserve.config import ServerConfig
from radixserve.ipc.client import EngineClient, EngineState
from radixserve.server.auth import ApiKeys
from radixserve.server.errors import APIError
from radixserve.server.generation import ChoiceChunk, ChoiceJob, stream_choice
from radixserve.server.limits import Admission
from radixserve.server.metrics import ServerMetrics
from radixserve.server.protocol import PromptInput, RequestOptions, check_token_ids
from radixserve.types import SamplingParams

OFFLOAD_CHARS = 2048  # tokenize longer inputs in a thread so one huge prompt stalls no one
INT64_SPAN = 2**64


def _load_tokenizer(path: Path) -> Any:
    # NOTE: radixserve.tokenizer imports transformers (seconds): imported here, in a worker
    # thread, so the server binds and the engine starts loading without waiting for it.
    from radixserve.tokenizer import load_tokenizer

    return load_tokenizer(path)


def _encode_prompt(tokenizer: Any, text: str) -> list[int]:
    from radixserve.tokenizer import encode_prompt  # already imported by _load_tokenizer

    return encode_prompt(tokenizer, text)


def _encode_chat(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    from radixserve.tokenizer import encode_chat

    return encode_chat(tokenizer, messages)


def _wrap_int64(value: int) -> int:
    return (value + 2**63) % INT64_SPAN - 2**63


class ServerState:
    def __init__(self, cfg: ServerConfig, client: EngineClient) -> None:
        self.cfg = cfg
        self.client = client
        # The admin key authenticates too (admin routes check that it is the admin's).
        admin = (cfg.admin_key,) if cfg.admin_key and cfg.api_keys else ()
        self.auth = ApiKeys(cfg.api_keys + admin, cfg.shared_cache)
        self.admission = Admission(cfg.max_concurrent_per_key, cfg.max_queue)
        self.metrics = ServerMetrics(lambda: self.client.stats)
        self.started = time.time()
        self.tokenizer: Any = None
        self.model_name = cfg.served_model_name or cfg.engine.model
        self.max_model_len = 0
        self.vocab_size = 0
        self.eos_ids: tuple[int, ...] = ()
        self._token_strs: dict[int, str] = {}

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
            early = loop.run_in_executor(None, _load_tokenizer, guess)
        info = await self.client.start()
        path = Path(info["model_path"])
        if early is not None and path.resolve() == guess.resolve():
            self.tokenizer = await early
        else:
            if early is not None:  # a wrong guess: retire it (and any error it raised)
                await asyncio.gather(early, return_exceptions=True)
            self.tokenizer = await loop.run_in_executor(None, _load_tokenizer, path)
        self.model_name = self.cfg.served_model_name or info.get("model") or self.model_name
        self.max_model_len = int(info["max_model_len"])
        self.vocab_size = int(info.get("vocab_size") or len(self.tokenizer))
        self.eos_ids = tuple(info.get("eos_token_ids") or ())

    def ensure_ready(self) -> None:
        if self.client.state is EngineState.DEAD:
            raise APIError(503, f"the engine is dead: {self.client.error}", code="engine_dead")
        if not self.ready:
            raise APIError(503, "the model is still loading", code="model_loading")

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in (self.model_name, self.cfg.engine.model):
            raise APIError(404, f"the model '{name}' does not exist; this server serves "
                                f"'{self.model_name}'", param="model", code="model_not_found")

    async def _offload(self, size: int, fn: Any, *args: Any) -> list[int]:
        if size <= OFFLOAD_CHARS:
            result: list[int] = fn(*args)
            return result
        return await asyncio.get_running_loop().run_in_executor(None, fn, *args)

    async def encode(self, prompt: PromptInput) -> list[int]:
        if isinstance(prompt, str):
            return await self._offload(len(prompt), _encode_prompt, self.tokenizer, prompt)
        check_token_ids(prompt, self.vocab_size, "prompt")
        return list(prompt)

    async def encode_messages(self, messages: Sequence[dict[str, str]]) -> list[int]:
        size = sum(len(m["content"]) for m in messages)
        try:
            return await self._offload(size, _encode_chat, self.tokenizer, list(messages))
        except ValueError as err:  # no chat template
            raise APIError(400, str(err), param="messages") from err
        except Exception as err:  # a template that rejects the conversation (jinja raise)
            if type(err).__module__.startswith("jinja2"):
                raise APIError(400, f"chat template error: {err}", param="messages") from err
            raise

    def finalize_params(self, params: SamplingParams, prompt_len: int,
                        param: str) -> SamplingParams:
        """Check the prompt against the limits and fix max_tokens (None: remaining context)."""
        limit, cap = self.max_model_len, self.cfg.max_tokens_cap
        if self.cfg.max_input_tokens is not None and prompt_len > self.cfg.max_input_tokens:
            raise APIError(400, f"the prompt has {prompt_len} tokens; this server accepts at most "
                                f"{self.cfg.max_input_tokens}", param=param,
                           code="input_too_long")
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

    def make_jobs(self, prompts: Sequence[list[int]], opts: RequestOptions, salt: str,
                  param: str) -> list[ChoiceJob]:
        """prompts x n choices; choice i of a seeded request samples with seed + i."""
        if opts.params.stop_token_ids:
            check_token_ids(opts.params.stop_token_ids, self.vocab_size, "stop_token_ids")
        jobs: list[ChoiceJob] = []
        for p_idx, ids in enumerate(prompts):
            params = self.finalize_params(opts.params, len(ids), param)
            for i in range(opts.n):
                choice_params = params
                if params.seed is not None and i:
                    choice_params = dataclasses.replace(params, seed=_wrap_int64(params.seed + i))
                jobs.append(ChoiceJob(len(jobs), p_idx, uuid.uuid4().hex, tuple(ids),
                                      choice_params, opts.stop, salt, opts.priority))
        return jobs

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
# The caller's key, set on each request by the auth middleware.
API_KEY_FIELD: web.RequestKey[str] = web.RequestKey("radixserve_api_key", str)


async def read_json(request: web.Request) -> Any:
    """The decoded body. A body over the app's client_max_size raises 413 here."""
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as err:
        raise APIError(413, f"the request body is too large: {err.text}",
                       code="body_too_large") from err
    if not raw:
        raise APIError(400, "the request body is empty; send a JSON object")
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as err:
        raise APIError(400, f"the request body is not valid JSON: {err}") from err


def request_key(request: web.Request) -> str:
    key: str = request.get(API_KEY_FIELD, "")
    return key
