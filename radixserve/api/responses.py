"""The OpenAI Responses API's request (POST /v1/responses), as the chat request it amounts to.

Owns: turning a Responses body (`input` items, `instructions`, function `tools`, `tool_choice`,
`text.format`, `max_output_tokens`) into the chat-completions body that protocol.parse_chat
then validates like any chat request, and `ResponsesEcho`, the request's settings a Response
object repeats. Input items map to chat messages: a message item to its role (developer ->
system), `function_call` items to the preceding assistant turn's tool_calls (or a new one),
`function_call_output` items to tool messages. `previous_response_id` continues a stored
response (response_store.py): its conversation items come first, then this `input`, and the
whole list is turned into messages as if the request had sent it all (`instructions` are this
request's own, as OpenAI does). What this server does not do is a 400 naming the field:
`conversation`, item references, images and files, built-in tools, background runs. The text's
logprobs (`include: ["message.output_text.logprobs"]`, `top_logprobs`) are served without tools.
Does not know: tokenizers, the engine, where responses are stored, the wire format of a
Response (server/routes/responses.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.api.fields import bad, check_fields, get_bool, get_int
from radixserve.api.protocol import MAX_LOGPROBS
from radixserve.api.response_store import normalize_input

# Sampling extras vLLM's Responses route also takes; parse_chat validates them.
_SAMPLING_EXTRAS = frozenset({
    "top_k", "min_p", "seed", "stop", "stop_token_ids", "repetition_penalty",
    "presence_penalty", "frequency_penalty", "ignore_eos", "min_tokens", "logit_bias",
    "priority", "timeout",
})
# Passed on to the chat body, which validates them (prompt_cache_key: a string, see protocol).
_PASSED = frozenset({"model", "temperature", "top_p", "stream", "parallel_tool_calls",
                     "prompt_cache_key"})
_HANDLED = frozenset({"input", "instructions", "max_output_tokens", "tools", "tool_choice",
                      "text", "store", "metadata", "user", "service_tier", "safety_identifier",
                      "include", "top_logprobs", "previous_response_id"})
LOGPROBS_INCLUDE = "message.output_text.logprobs"  # the one `include` value served
# Accepted at their no-op value only: anything else asks for what this server does not do.
_NEUTRAL: dict[str, tuple[Any, str]] = {
    "conversation": (None, "conversations are not supported: chain responses with "
                           "'previous_response_id' or send the history in 'input'"),
    "prompt": (None, "stored prompt templates are not supported"),
    "background": (False, "background responses are not supported"),
    "truncation": ("disabled", "only 'disabled' is supported (an over-long input is a 400)"),
    "reasoning": (None, "reasoning effort and summaries are not supported"),
    "max_tool_calls": (None, "'max_tool_calls' is not supported"),
}
RESPONSES_FIELDS = _SAMPLING_EXTRAS | _PASSED | _HANDLED | frozenset(_NEUTRAL)
_TEXT_PARTS = {"input_text", "output_text", "text", "refusal"}


@dataclass(frozen=True)
class ResponsesEcho:
    """The settings a Response object repeats back, as the client sent them (defaults filled;
    temperature and top_p are echoed from the sampling parameters actually used)."""

    instructions: str | None = None
    max_output_tokens: int | None = None
    tools: list[dict[str, Any]] = field(default_factory=list)
    tool_choice: Any = "auto"
    text: dict[str, Any] = field(default_factory=lambda: {"format": {"type": "text"}})
    parallel_tool_calls: bool = True
    metadata: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    store: bool = True  # OpenAI's default: kept for previous_response_id and GET
    previous_response_id: str | None = None


def _neutral(body: dict[str, Any]) -> None:
    for name, (ok, why) in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and value != ok and not (ok is None and value == {}):
            if name == "reasoning" and isinstance(value, dict) and not any(value.values()):
                continue  # {"effort": null}: nothing asked
            raise bad(f"unsupported value for '{name}': {why}", name)


def _content_text(content: Any, where: str) -> str:
    """A string, or a list of text parts joined by newlines; `where` names the field."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"'{where}' must be a string or a list of content parts", where)
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise bad(f"'{where}[{k}]': only text parts ({sorted(_TEXT_PARTS)}) are "
                      f"supported, got {kind!r}", f"{where}[{k}]")
        text = part.get("refusal" if kind == "refusal" else "text")
        if not isinstance(text, str):
            raise bad(f"'{where}[{k}].text' must be a string", f"{where}[{k}]")
        texts.append(text)
    return "\n".join(texts)


def _function_call(item: dict[str, Any], where: str) -> dict[str, Any]:
    check_fields(item, frozenset({"type", "id", "call_id", "name", "arguments", "status"}), where)
    for key in ("call_id", "name"):
        if not isinstance(item.get(key), str) or not item[key]:
            raise bad(f"'{where}.{key}' must be a non-empty string", f"{where}.{key}")
    args = item.get("arguments", "{}")
    if not isinstance(args, str):
        raise bad(f"'{where}.arguments' must be a JSON string", f"{where}.arguments")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": args}}


def input_messages(value: Any, instructions: str | None) -> list[dict[str, Any]]:
    """`input` (a string, or a list of items) as chat messages, `instructions` first."""
    messages: list[dict[str, Any]] = []
    if instructions:
        messages.append({"role": "system", "content": instructions})
    if isinstance(value, str):
        return [*messages, {"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise bad("'input' must be a string or a non-empty list of input items", "input")
    for i, item in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad(f"'{where}' must be an object", where)
        kind = item.get("type", "message")
        if kind == "message":
            check_fields(item, frozenset({"type", "role", "content", "id", "status"}), where)
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad(f"'{where}.role' must be user, system, developer or assistant, got "
                          f"{role!r}", f"{where}.role")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _content_text(item.get("content"),
                                                      f"{where}.content")})
        elif kind == "function_call":
            call = _function_call(item, where)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            check_fields(item, frozenset({"type", "id", "call_id", "output", "status"}), where)
            if not isinstance(item.get("call_id"), str) or not item["call_id"]:
                raise bad(f"'{where}.call_id' must be a non-empty string", f"{where}.call_id")
            output = item.get("output")
            text = _content_text(output, f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": text})
        else:
            raise bad(f"'{where}.type' {kind!r} is not supported (message, function_call and "
                      "function_call_output items are)", f"{where}.type")
    return messages


def _tools(value: Any) -> list[dict[str, Any]] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise bad("'tools' must be a list", "tools")
    out = []
    for i, tool in enumerate(value):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise bad(f"'{where}': only function tools are supported, got type {kind!r}", where)
        check_fields(tool, frozenset({"type", "name", "description", "parameters", "strict"}),
                     where)
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict")
              if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value  # parse_chat checks the names
    if isinstance(value, dict) and value.get("type") == "function":
        check_fields(value, frozenset({"type", "name"}), "tool_choice")
        return {"type": "function", "function": {"name": value.get("name")}}
    raise bad("'tool_choice' must be \"auto\", \"none\", \"required\" or "
              "{\"type\": \"function\", \"name\": ...}", "tool_choice")


def _response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    text = check_fields(text, frozenset({"format", "verbosity"}), "text")
    fmt = text.get("format")
    if fmt is None:
        return None
    fmt = check_fields(fmt, frozenset({"type", "name", "schema", "strict", "description"}),
                       "text.format")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("name"), str) or not fmt["name"]:
            raise bad("'text.format.name' must be a non-empty string", "text.format.name")
        spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": spec}
    raise bad(f"'text.format.type' must be text, json_object or json_schema, got {kind!r}",
              "text.format.type")


def _logprobs(body: dict[str, Any]) -> int | None:
    """Top alternatives per token when `include` asks for the text's logprobs, else None."""
    include = body.get("include") or []
    if not isinstance(include, list) or any(v != LOGPROBS_INCLUDE for v in include):
        raise bad(f"'include' may hold only {LOGPROBS_INCLUDE!r}", "include")
    top = get_int(body, "top_logprobs", lo=0, hi=MAX_LOGPROBS)
    if not include:
        if top:
            raise bad(f"'top_logprobs' requires 'include': [{LOGPROBS_INCLUDE!r}]",
                      "top_logprobs")
        return None
    if body.get("tools"):
        raise bad("logprobs are not supported together with tools on /v1/responses", "include")
    return top or 0


# previous_response_id -> the stored conversation items; raises APIError 404 when there is
# none for this caller.
History = Callable[[str], list[dict[str, Any]]]


@dataclass(frozen=True)
class ResponsesRequest:
    chat: dict[str, Any]  # the chat-completions body it amounts to
    echo: ResponsesEcho
    input_items: list[dict[str, Any]]  # the whole conversation it answers, as stored


def _previous(body: dict[str, Any], history: History) -> list[dict[str, Any]]:
    prev = body.get("previous_response_id")
    if prev is None:
        return []
    if not isinstance(prev, str) or not prev:
        raise bad("'previous_response_id' must be a non-empty string", "previous_response_id")
    return history(prev)


def parse_responses(body: Any, history: History) -> ResponsesRequest:
    """A Responses request, continuing a stored response when it names one."""
    chat, echo = to_chat_body(body)
    items = normalize_input(body["input"])
    before = _previous(body, history)
    if before:
        chat["messages"] = input_messages([*before, *items], echo.instructions)
    return ResponsesRequest(chat, echo, [*before, *items])


def to_chat_body(body: Any) -> tuple[dict[str, Any], ResponsesEcho]:
    """The chat-completions body this Responses request amounts to on its own (without the
    history `previous_response_id` adds: parse_responses), and its echo."""
    body = check_fields(body, RESPONSES_FIELDS)
    _neutral(body)
    store = get_bool(body, "store") is not False
    prev = body.get("previous_response_id")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad("'instructions' must be a string", "instructions")
    if "input" not in body:
        raise bad("'input' is required", "input")
    max_out = get_int(body, "max_output_tokens", lo=1)
    metadata = body.get("metadata") or {}
    if not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise bad("'metadata' must be an object of strings", "metadata")
    chat: dict[str, Any] = {k: body[k] for k in _SAMPLING_EXTRAS | _PASSED if k in body}
    chat["messages"] = input_messages(body["input"], instructions)
    tools = _tools(body.get("tools"))
    if tools is not None:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    if max_out is not None:
        chat["max_tokens"] = max_out
    top = _logprobs(body)
    if top is not None:
        chat["logprobs"], chat["top_logprobs"] = True, top
    echo = ResponsesEcho(
        instructions=instructions, max_output_tokens=max_out,
        tools=list(body.get("tools") or []), tool_choice=body.get("tool_choice") or "auto",
        text={"format": (body.get("text") or {}).get("format") or {"type": "text"}},
        parallel_tool_calls=body.get("parallel_tool_calls") is not False,
        metadata=dict(metadata), user=body.get("user") if isinstance(body.get("user"), str)
        else None, store=store, previous_response_id=prev if isinstance(prev, str) else None)
    return chat, echo

