"""LLM: the offline API, `LLM(model=...).generate(prompts, SamplingParams(...))`, as vLLM's.

Owns: turning prompts (text, token ids, chat conversations) into engine requests, running the
engine until they finish, and collecting one RequestOutput per prompt, in input order.
Chats with tools are rendered and their calls read back exactly as the HTTP server does
(api/tools/prompt.py, api/tools/stream.py), so a prompt here and over HTTP share a cache
prefix. Does not know: HTTP, processes. Runs the engine in the calling thread.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Union

from radixserve.api.constraints.check import ConstraintChecker
from radixserve.api.lengths import choice_seed
from radixserve.api.tools.stream import tool_message
from radixserve.config import EngineConfig, kv_events_config_from
from radixserve.engine.engine import Engine
from radixserve.ipc.messages import GenerateMsg
from radixserve.lora.namespace import check_client_salt
from radixserve.lora.offline import lora_per_prompt, pop_lora_config
from radixserve.types import InvalidRequestError, SamplingParams, TemplateOptions, TokenLogprobs

if TYPE_CHECKING:
    from radixserve.kv_events.zmq_stream import OfflineKVEvents
    from radixserve.lora.request import LoRARequest

Prompt = Union[str, Sequence[int]]
Message = dict[str, Any]
FinishReasonName = Literal["stop", "length", "abort"]


@dataclass
class RequestOutput:
    """One prompt's result. Field names follow vLLM's, flattened: the fields are those of the
    prompt's first sequence, and `outputs` lists all of them (SamplingParams.n, each with the
    same fields and its `index`)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReasonName | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    error: str | None = None  # the request failed in the engine (its grammar did not compile)
    ttft: float = 0.0  # seconds from submission to the first token
    latency: float = 0.0  # seconds from submission to the finish
    # LLM.chat(tools=...): the calls read from `text`, in OpenAI's wire shape ({"id", "type":
    # "function", "function": {"name", "arguments": JSON text}}); empty when it called none
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    index: int = 0  # which of the prompt's n sequences
    # sequences 1..n-1 of the prompt (SamplingParams.n); this object is sequence 0
    siblings: list[RequestOutput] = field(default_factory=list, repr=False)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def outputs(self) -> list[RequestOutput]:
        """vLLM's `out.outputs[i].text` spelling: the prompt's sequences, in order."""
        return [self, *self.siblings]


class LLM:
    """Offline API: `LLM(model=...).generate(prompts, SamplingParams(...))`.

    `engine_kwargs` are EngineConfig fields (dtype, kv_cache_tokens, page_size, ...).
    `kv_events_config`: vLLM's KV-event config (a dict, its JSON, or a KVEventsConfig):
    block events over ZMQ as `radixserve serve --kv-events-config` publishes them; `close()`
    releases the sockets. vLLM's `enable_lora`, `max_loras`, `max_lora_rank`, `max_cpu_loras`
    turn on multi-LoRA serving (generate's `lora_request`).
    """

    def __init__(self, model: str = "smollm2-135m", show_progress: bool = False,
                 kv_events_config: Any = None, **engine_kwargs: Any) -> None:
        kv_cfg = None if kv_events_config is None else kv_events_config_from(kv_events_config)
        if kv_cfg is not None and kv_cfg.publishes:
            engine_kwargs["enable_kv_events"] = True
        engine_kwargs["lora"] = pop_lora_config(engine_kwargs)
        self.engine = Engine(EngineConfig(model=model, **engine_kwargs), show_progress)
        from radixserve.tokenizer import load_tokenizer

        self.tokenizer = load_tokenizer(self.engine.runner.resolved.hf_dir)
        self._ids = itertools.count()
        # Schemas are checked as the engine compiles them (closed objects unless the engine's
        # structured_outputs_allow_additional_properties): InvalidRequestError, as vLLM raises.
        self._check = ConstraintChecker(allow_additional_properties=self.engine.cfg
                                        .structured_outputs_allow_additional_properties)
        self.kv_events: OfflineKVEvents | None = None
        if kv_cfg is not None and kv_cfg.publishes:
            from radixserve.kv_events.zmq_stream import OfflineKVEvents

            self.kv_events = OfflineKVEvents(kv_cfg, str(self.engine.runner.device))

    def _step(self) -> list[Any]:
        outputs = self.engine.step()
        if self.kv_events is not None:
            self.kv_events.feed(self.engine.drain_cache_events())
        return outputs

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        cache_salt: str | Sequence[str] = "",
        priority: int | Sequence[int] = 0,
        *,
        use_tqdm: bool = False,
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Submit every prompt at once (one continuous batch) and run until all finish.

        `prompts`: one string, a list of strings, or a list of token-id lists.
        `sampling_params` (vLLM's name; `params` is the older spelling), `cache_salt` and
        `priority` (lower = more important): one for all, or one per prompt (a length mismatch
        raises ValueError). `use_tqdm`: a progress bar of finished prompts. `lora_request`: a
        LoRARequest (or None, the base model) for all prompts or one per prompt.
        """
        from radixserve.tokenizer import encode_prompt

        params = _one_of(sampling_params, params)
        prompt_list = _as_prompt_list(prompts)
        n = len(prompt_list)
        params_list = _per_prompt(params if params is not None else SamplingParams(), n,
                                  SamplingParams, "params")
        salts = _per_prompt(cache_salt, n, str, "cache_salt")
        priorities = _per_prompt(priority, n, int, "priority")
        loras = lora_per_prompt(lora_request, n, self.engine.lora is not None)
        for salt in salts:
            check_client_salt(salt)  # the adapters' namespaces are the engine's alone
        for p in params_list:
            if p.constraint is not None:
                self._check(p.constraint, "constraint")
        results: dict[str, RequestOutput] = {}  # every sequence, by engine request id
        firsts: list[RequestOutput] = []  # sequence 0 of each prompt, in order
        try:
            for prompt, p, salt, prio, lora in zip(prompt_list, params_list, salts, priorities,
                                                   loras, strict=True):
                ids = (encode_prompt(self.tokenizer, prompt) if isinstance(prompt, str)
                       else [int(t) for t in prompt])
                for i in range(p.n):  # the shared prompt is computed once (radix cache)
                    rid = f"offline-{next(self._ids)}"
                    self.engine.add_request(GenerateMsg(
                        rid, ids, _sequence_params(p, i), salt, prio,
                        lora_name=None if lora is None else lora.lora_name,
                        lora_path=None if lora is None else lora.lora_path))
                    out = results[rid] = RequestOutput(rid, ids, index=i)
                    if i == 0:
                        firsts.append(out)
                    else:
                        firsts[-1].siblings.append(out)
        except Exception:
            for rid in results:  # all or nothing: withdraw the prompts already queued
                self.engine.abort(rid)
            while self.engine.has_work():
                self._step()
            raise
        self._run(results, use_tqdm)
        return firsts

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        tool_choice: str | dict[str, Any] | None = None,
        tool_call_parser: str = "hermes",
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Render each conversation with the model's chat template and generate; one
        conversation (a list of message dicts) is accepted too. One output per conversation.

        vLLM's keywords: `add_generation_prompt`, `continue_final_message` (leave the last,
        assistant, message open), `chat_template_kwargs` (extra template variables), `tools`
        (OpenAI's tool list; `tool_choice` "auto" | "none" | "required" | a named function).
        With tools, the calls are read back into `output.tool_calls` (the text stays raw), in
        the format of `tool_call_parser` (the server's --tool-call-parser: "hermes" or
        "llama3_json"); "required" and a named function are enforced by grammar, as over
        HTTP. Messages and tools are validated as the server does (InvalidRequestError, a
        ValueError, naming the field).
        """
        from radixserve.api.chat_messages import parse_messages
        from radixserve.api.tools.parsers import get_format
        from radixserve.api.tools.prompt import supports_tools, template_messages
        from radixserve.api.tools.tool_fields import parse_tools
        from radixserve.tokenizer import encode_chat

        if not messages:
            return []
        convs = [messages] if isinstance(messages[0], dict) else list(messages)
        options = TemplateOptions(add_generation_prompt and not continue_final_message,
                                  continue_final_message, dict(chat_template_kwargs or {}))
        spec = parse_tools({"tools": tools, "tool_choice": tool_choice}, self._check)
        try:
            fmt = get_format(tool_call_parser)
        except ValueError as e:
            raise InvalidRequestError(str(e), "tool_call_parser") from e
        native = supports_tools(getattr(self.tokenizer, "chat_template", None))
        prompts = []
        for conv in convs:
            parsed = parse_messages(list(conv))
            options.check_messages([m["role"] for m in parsed])
            msgs, tool_list = template_messages(parsed, spec, fmt, native)
            prompts.append(encode_chat(self.tokenizer, msgs, tools=tool_list, options=options))
        params = _one_of(sampling_params, params)
        # As over HTTP: the tool-call grammar (it lets "auto" write text or calls, and makes
        # "required" / a named function write a call).
        calls = None if spec is None else spec.constraint(tool_call_parser)
        if calls is not None:
            plist = _per_prompt(params if params is not None else SamplingParams(),
                                len(prompts), SamplingParams, "sampling_params")
            if any(p.constraint is not None for p in plist):
                raise InvalidRequestError("an output constraint cannot be combined with tools "
                                          "unless tool_choice is \"none\"", "tools")
            params = [replace(p, constraint=calls) for p in plist]
        outs = self.generate(prompts, params, use_tqdm=use_tqdm)
        if spec is not None and spec.parses_calls:
            for out in (seq for o in outs for seq in o.outputs):
                message, _ = tool_message(fmt, out.text)
                out.tool_calls = list(message.get("tool_calls", []))
        return outs

    def kv_stats(self) -> dict[str, Any]:
        return self.engine.stats()

    def close(self) -> None:
        """Stop the engine's tier threads; with --kv-offload-dir (write-back), write the pool
        to the local tier first, so that a later LLM on the same directory starts warm; stop
        publishing KV events."""
        self.engine.close()
        if self.kv_events is not None:
            self.kv_events.close()
            self.kv_events = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, results: dict[str, RequestOutput], use_tqdm: bool = False) -> None:
        from tqdm import tqdm

        start = time.perf_counter()
        bar = tqdm(total=len(results), desc="Processed prompts", disable=not use_tqdm)
        while self.engine.has_work():
            for out in self._step():
                res = results.get(out.rid)
                if res is None:
                    continue  # a request of an earlier call that was aborted
                now = time.perf_counter() - start
                if out.token_id is not None:
                    if not res.token_ids:
                        res.ttft = now
                    res.token_ids.append(out.token_id)
                    res.num_cached_tokens = out.num_cached_tokens
                if out.logprobs is not None:
                    res.logprobs.append(out.logprobs)
                if out.finish_reason is not None:
                    res.finish_reason, res.latency = out.finish_reason.value, now
                    res.error = out.error
                    bar.update(1)
        bar.close()
        for res in results.values():
            text = self.tokenizer.decode(res.token_ids, skip_special_tokens=True)
            res.text = text if isinstance(text, str) else "".join(text)


def _sequence_params(p: SamplingParams, i: int) -> SamplingParams:
    """Sequence i of a prompt: one engine request; a seeded one samples with seed + i (as the
    server's choice i of `n` does)."""
    if p.n == 1:
        return p
    return replace(p, n=1, seed=choice_seed(p.seed, i))


def _one_of(sampling_params: Any, params: Any) -> Any:
    if sampling_params is not None and params is not None:
        raise TypeError("pass 'sampling_params' or its older spelling 'params', not both")
    return sampling_params if sampling_params is not None else params


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items: list[Any] = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        raise TypeError("pass token ids as a list of lists (one list per prompt), "
                        "e.g. generate([[1, 2, 3]])")
    return items


def _per_prompt(value: Any, n: int, kind: type, name: str) -> list[Any]:
    if isinstance(value, kind):
        return [value] * n
    values = list(value)
    if len(values) != n:
        raise ValueError(f"got {n} prompts but {len(values)} {name}: pass one {name} for all "
                         f"prompts or exactly one per prompt")
    return values
