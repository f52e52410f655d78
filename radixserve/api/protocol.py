"""Request parsing and validation for the OpenAI routes and the native /generate route.

Owns: turning a decoded JSON body into a typed request (CompletionRequest, ChatRequest,
GenerateRequest), and rejecting anything malformed, out of range or unsupported with an
InvalidRequestError that names the parameter (the app turns it into a 400).
Does not know: tokenizers, the engine, HTTP, the model's context length (checked later).
Every field outside a route's list is handled by the policy in fields.py (ignored when
harmless, accepted at its no-op value, otherwise rejected by name).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Union

from radixserve.api.api_keys import MAX_ABS_PRIORITY
from radixserve.api.chat_messages import parse_messages, parse_template_options
from radixserve.api.constraints.check import Check
from radixserve.api.constraints.extra import EXTRA_CONSTRAINT_FIELDS, parse_extra_constraint
from radixserve.api.constraints.native_fields import (
    NATIVE_CONSTRAINT_FIELDS,
    parse_native_constraint,
)
from radixserve.api.constraints.response_format import parse_response_format
from radixserve.api.fields import (
    bad,
    check_fields,
    get_bool,
    get_float,
    get_int,
    get_str,
    is_int,
    parse_token_ids,
)
from radixserve.api.prediction import parse_prediction
from radixserve.api.tools.tool_fields import ToolsSpec, parse_tools
from radixserve.constraints import Constraint
from radixserve.grammar.validate import check_constraint
from radixserve.types import SamplingParams, TemplateOptions

__all__ = ["parse_chat", "parse_completion", "parse_generate"]

PromptInput = Union[str, tuple[int, ...]]  # text, or token ids

MAX_N = 128
MAX_CHOICES = 256  # prompts x n in one request
MAX_STOP_STRINGS = 32
MAX_LOGPROBS = 20
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
GENERATE_DEFAULT_MAX_TOKENS = 128  # SGLang's default for native /generate
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_TIMEOUT_S = 86400.0

_SAMPLING_FIELDS = frozenset({
    "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "stop", "stop_token_ids", "seed", "ignore_eos", "min_tokens",
    "max_tokens", "max_completion_tokens", "logit_bias",
})
_OPENAI_FIELDS = _SAMPLING_FIELDS | {"model", "n", "stream", "stream_options", "priority",
                                     "timeout", "return_token_ids", "prompt_cache_key"}
COMPLETION_FIELDS = _OPENAI_FIELDS | EXTRA_CONSTRAINT_FIELDS | {
    "prompt", "echo", "logprobs", "response_format", "prediction"}
CHAT_FIELDS = _OPENAI_FIELDS | EXTRA_CONSTRAINT_FIELDS | {
    "prediction", "messages", "logprobs", "top_logprobs", "response_format", "tools", "tool_choice",
    "parallel_tool_calls", "add_generation_prompt", "continue_final_message",
    "chat_template_kwargs"}
GENERATE_FIELDS = frozenset({"text", "input_ids", "sampling_params", "stream", "priority",
                             "timeout", "continue_output_tokens", "return_logprob",
                             "top_logprobs_num"})
GENERATE_SAMPLING_FIELDS = (_SAMPLING_FIELDS - {"max_tokens", "max_completion_tokens"}) | {
    "max_new_tokens", "min_new_tokens", "n", *NATIVE_CONSTRAINT_FIELDS,
}


@dataclass(frozen=True)
class RequestOptions:
    """What every route shares. `params.max_tokens is None` means "fill the remaining context"."""

    model: str | None
    params: SamplingParams
    n: int
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    # Lower = more important (vLLM); orders admission, preemption, eviction, and who a full
    # queue refuses. None: not given (the caller's key decides; auth.Caller.priority_for).
    priority: int | None = None
    timeout: float | None = None  # seconds from arrival; the server's --request-timeout caps it
    # vLLM's `return_token_ids`: stream chunks carry each choice's `token_ids` (and its first
    # chunk the `prompt_token_ids`); the router resumes a broken stream from them.
    return_token_ids: bool = False
    # OpenAI's Predicted Outputs: text the output is expected to repeat (a draft source).
    prediction: str | None = None
    # OpenAI's cache-routing hint. The router reads it from the body for affinity; a replica
    # only validates it (its own radix cache finds shared prefixes without a hint).
    prompt_cache_key: str | None = None


@dataclass(frozen=True)
class CompletionRequest:
    prompts: tuple[PromptInput, ...]
    opts: RequestOptions
    echo: bool


@dataclass(frozen=True)
class ChatRequest:
    messages: tuple[dict[str, Any], ...]  # normalized by chat_messages.parse_messages
    opts: RequestOptions  # opts.params.constraint: from response_format or tool_choice
    tools: ToolsSpec | None = None
    template: TemplateOptions = field(default_factory=TemplateOptions)


@dataclass(frozen=True)
class GenerateRequest:
    prompt: PromptInput
    opts: RequestOptions
    # The last N input ids are this request's own earlier output (a router resuming a broken
    # stream): replayed through the detokenizer and stop matcher, their text not sent again.
    num_continued: int = 0


def _parse_stop(body: dict[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise bad("'stop' must be a string or a list of strings", "stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad(f"'stop' holds at most {MAX_STOP_STRINGS} strings, got {len(stops)}", "stop")
    if any(s == "" for s in stops):
        raise bad("'stop' strings must not be empty", "stop")
    return tuple(dict.fromkeys(stops))


def _parse_sampling(body: dict[str, Any], max_tokens: int | None, min_tokens: int | None,
                    logprobs: int | None) -> SamplingParams:
    kwargs: dict[str, Any] = {}
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty"):
        value = get_float(body, name)
        if value is not None:
            kwargs[name] = value
    top_k = get_int(body, "top_k")
    if top_k is not None:
        kwargs["top_k"] = top_k
    if min_tokens is not None:
        if max_tokens is not None and min_tokens > max_tokens:
            raise bad(f"min_tokens ({min_tokens}) must be <= max_tokens ({max_tokens})",
                      "min_tokens")
        kwargs["min_tokens"] = min_tokens
    if body.get("stop_token_ids") is not None:
        kwargs["stop_token_ids"] = parse_token_ids(body["stop_token_ids"], "stop_token_ids")
    kwargs["ignore_eos"] = bool(get_bool(body, "ignore_eos"))
    kwargs["seed"] = get_int(body, "seed", INT64_MIN, INT64_MAX)
    if body.get("logit_bias") is not None:
        kwargs["logit_bias"] = _parse_logit_bias(body["logit_bias"])
    return SamplingParams(max_tokens=max_tokens, logprobs=logprobs, **kwargs)


def _parse_logit_bias(value: Any) -> dict[int, float]:
    """OpenAI's shape: {"<token id>": bias}; JSON keys are strings. Ranges: SamplingParams."""
    if not isinstance(value, dict):
        raise bad("'logit_bias' must be an object mapping token ids to numbers", "logit_bias")
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            tok = int(key)
        except ValueError:
            raise bad(f"'logit_bias' keys must be token ids, got {key!r}", "logit_bias") from None
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise bad(f"'logit_bias' values must be numbers, got {bias!r}", "logit_bias")
        out[tok] = float(bias)
    return out


def _parse_options(body: dict[str, Any], default_max_tokens: int | None,
                   logprobs: int | None) -> RequestOptions:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad("'model' must be a string", "model")
    max_tokens = get_int(body, "max_completion_tokens", lo=1)
    if max_tokens is None:
        max_tokens = get_int(body, "max_tokens", lo=1)
    if max_tokens is None:
        max_tokens = default_max_tokens
    params = _parse_sampling(body, max_tokens, get_int(body, "min_tokens", lo=0), logprobs)
    n = get_int(body, "n", lo=1, hi=MAX_N) or 1
    stream = bool(get_bool(body, "stream"))
    include_usage = False
    stream_options = body.get("stream_options")
    if stream_options is not None:
        if not stream:
            raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
        check_fields(stream_options, frozenset({"include_usage"}), "stream_options")
        include_usage = bool(get_bool(stream_options, "include_usage", "stream_options"))
    priority = get_int(body, "priority", lo=-MAX_ABS_PRIORITY, hi=MAX_ABS_PRIORITY)
    timeout = get_float(body, "timeout")
    if timeout is not None and not 0 < timeout <= MAX_TIMEOUT_S:
        raise bad(f"'timeout' must be in (0, {MAX_TIMEOUT_S}] seconds, got {timeout}", "timeout")
    return RequestOptions(model, params, n, _parse_stop(body), stream, include_usage, priority,
                          timeout, bool(get_bool(body, "return_token_ids")),
                          parse_prediction(body.get("prediction")), get_str(body, "prompt_cache_key"))


def _parse_prompts(value: Any) -> tuple[PromptInput, ...]:
    """OpenAI's four prompt shapes: str, [str], [int], [[int]]."""
    if isinstance(value, str):
        prompts: list[Any] = [value]
    elif isinstance(value, list) and value and all(is_int(x) for x in value):
        prompts = [value]
    elif isinstance(value, list) and value:
        prompts = value
    elif isinstance(value, list):
        raise bad("'prompt' must not be empty", "prompt")
    else:
        raise bad("'prompt' must be a string, a list of strings or a list of token ids", "prompt")
    parsed: list[PromptInput] = []
    for prompt in prompts:
        if isinstance(prompt, str):
            if not prompt:
                raise bad("'prompt' must not be empty", "prompt")
            parsed.append(prompt)
        elif isinstance(prompt, list) and prompt:
            parsed.append(parse_token_ids(prompt, "prompt"))
        else:
            raise bad("each prompt must be a non-empty string or list of token ids", "prompt")
    return tuple(parsed)


def parse_completion(body: Any, check: Check = check_constraint) -> CompletionRequest:
    """`check` validates a response_format schema (a ConstraintChecker remembers passes)."""
    body = check_fields(body, COMPLETION_FIELDS)
    if "prompt" not in body:
        raise bad("'prompt' is required", "prompt")
    prompts = _parse_prompts(body["prompt"])
    logprobs = get_int(body, "logprobs", lo=0, hi=MAX_LOGPROBS)
    opts = _with_constraint(_parse_options(body, COMPLETIONS_DEFAULT_MAX_TOKENS, logprobs),
                            _output_constraint(body, check))
    echo = bool(get_bool(body, "echo"))
    if echo and logprobs is not None:
        raise bad("'echo' together with 'logprobs' is not supported (no prompt logprobs)", "echo")
    if len(prompts) * opts.n > MAX_CHOICES:
        raise bad(f"prompts x n must be <= {MAX_CHOICES}", "n")
    return CompletionRequest(prompts, opts, echo)


def _output_constraint(body: dict[str, Any], check: Check) -> Constraint | None:
    """From response_format, or from vLLM's / SGLang's extra fields: one of them at most."""
    constraint = parse_response_format(body.get("response_format"), check)
    extra = parse_extra_constraint(body, check)
    if constraint is not None and extra is not None:
        raise bad("'response_format' cannot be combined with another output constraint",
                  "response_format")
    return constraint or extra


def _with_constraint(opts: RequestOptions, constraint: Constraint | None) -> RequestOptions:
    if constraint is None:
        return opts
    return replace(opts, params=replace(opts.params, constraint=constraint))


def parse_chat(body: Any, call_format: str = "hermes",
               check: Check = check_constraint) -> ChatRequest:
    """`call_format`: the server's --tool-call-parser (the grammar writes calls that way);
    `check` validates tool and response_format schemas."""
    body = check_fields(body, CHAT_FIELDS)
    parsed = parse_messages(body.get("messages"))
    template = parse_template_options(body, [m["role"] for m in parsed])
    tools = parse_tools(body, check)
    constraint = _output_constraint(body, check)
    tool_constraint = None if tools is None else tools.constraint(call_format)
    if constraint is not None and tool_constraint is not None:
        raise bad("an output constraint ('response_format', ...) cannot be combined with tools "
                  "unless 'tool_choice' is \"none\"", "response_format")
    want_logprobs = bool(get_bool(body, "logprobs"))
    top = get_int(body, "top_logprobs", lo=0, hi=MAX_LOGPROBS)
    if top is not None and not want_logprobs:
        raise bad("'top_logprobs' requires 'logprobs' to be true", "top_logprobs")
    opts = _parse_options(body, None, (top or 0) if want_logprobs else None)
    return ChatRequest(parsed, _with_constraint(opts, constraint or tool_constraint), tools,
                       template)


def parse_generate(body: Any, check: Check = check_constraint) -> GenerateRequest:
    """SGLang's native shape: `text` or `input_ids`, a `sampling_params` object, `stream`."""
    body = check_fields(body, GENERATE_FIELDS)
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if has_text == has_ids:
        raise bad("exactly one of 'text' and 'input_ids' is required", "text")
    prompt: PromptInput
    if has_text:
        if not isinstance(body["text"], str) or not body["text"]:
            raise bad("'text' must be a non-empty string", "text")
        prompt = body["text"]
    else:
        prompt = parse_token_ids(body["input_ids"], "input_ids")
        if not prompt:
            raise bad("'input_ids' must not be empty", "input_ids")
    sp = body.get("sampling_params")
    sp = check_fields({} if sp is None else sp, GENERATE_SAMPLING_FIELDS, "sampling_params")
    if get_int(sp, "n", lo=1) not in (None, 1):
        raise bad("native /generate takes n = 1 only", "n")
    constraint = parse_native_constraint(sp, check)
    renamed = {k: v for k, v in sp.items() if k not in ("max_new_tokens", "min_new_tokens", "n")}
    renamed["max_tokens"] = sp.get("max_new_tokens", GENERATE_DEFAULT_MAX_TOKENS)
    renamed["min_tokens"] = sp.get("min_new_tokens")
    renamed["stream"] = body.get("stream")
    renamed["priority"] = body.get("priority")
    renamed["timeout"] = body.get("timeout")
    top = get_int(body, "top_logprobs_num", lo=0, hi=MAX_LOGPROBS)
    opts = _parse_options(renamed, None,
                          (top or 0) if get_bool(body, "return_logprob") else None)
    if constraint is not None:
        opts = replace(opts, params=replace(opts.params, constraint=constraint))
    return GenerateRequest(prompt, opts, _num_continued(body, prompt))


def _num_continued(body: dict[str, Any], prompt: PromptInput) -> int:
    num = get_int(body, "continue_output_tokens", lo=0) or 0
    if num and isinstance(prompt, str):
        raise bad("'continue_output_tokens' needs 'input_ids'", "continue_output_tokens")
    if num and num >= len(prompt):
        raise bad("'continue_output_tokens' must leave at least one prompt token",
                  "continue_output_tokens")
    return num
