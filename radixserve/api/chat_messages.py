"""Chat messages as the API accepts them: roles, text content, tool calls and tool results.

Owns: validating `messages` and normalizing each to a plain dict:
  {"role": "system" | "user" | "assistant" | "tool", "content": str}
  + for an assistant turn that called tools: "tool_calls": [{"id", "type": "function",
    "function": {"name", "arguments": <JSON text>}}] (its content may then be "")
  + for a tool result: "tool_call_id": str
  + for an assistant turn sent back with its thinking: "reasoning_content": str
Every malformed message is an InvalidRequestError naming `messages[i]...`. Also the request's
template options (add_generation_prompt, continue_final_message, chat_template_kwargs).
Does not know: chat templates or how tools are rendered (tools/prompt.py), HTTP.
"""

from __future__ import annotations

from typing import Any

import orjson

from radixserve.api.fields import bad, check_fields, get_bool
from radixserve.types import TemplateOptions

CHAT_ROLES = {"system": "system", "developer": "system", "user": "user",
              "assistant": "assistant", "tool": "tool"}
_FIELDS = {
    "system": frozenset({"role", "content", "name"}),
    "user": frozenset({"role", "content", "name"}),
    "assistant": frozenset({"role", "content", "name", "tool_calls", "refusal",
                            "reasoning_content", "reasoning"}),
    "tool": frozenset({"role", "content", "tool_call_id", "name"}),
}


# Content parts of OpenAI's (and vLLM's) multimodal chat: refused by name, since the engine
# serves text models (a multimodal checkpoint such as Gemma3ForConditionalGeneration runs its
# language model alone, as vLLM does when no image is sent).
_MEDIA_PARTS = frozenset({"image_url", "input_image", "image", "image_pil", "image_embeds",
                          "input_audio", "audio_url", "video_url", "file"})


def _text(content: Any, where: str) -> str:
    """A string, or OpenAI's list of text parts joined by newlines."""
    if isinstance(content, list):
        texts = []
        for i, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind in _MEDIA_PARTS:
                raise bad(f"'{where}.content[{i}]' is of type {kind!r}: this server takes text "
                          "only (a multimodal model runs its language model alone); send "
                          "text parts", f"{where}.content")
            if not (isinstance(part, dict) and kind == "text"
                    and isinstance(part.get("text"), str)):
                raise bad(f"'{where}.content' parts must be {{\"type\": \"text\", \"text\": str}}"
                          " (other content types are not supported)", f"{where}.content")
            texts.append(part["text"])
        return "\n".join(texts)
    if not isinstance(content, str):
        raise bad(f"'{where}.content' must be a string or a list of text parts",
                  f"{where}.content")
    return content


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    if not isinstance(call, dict):
        raise bad(f"'{where}' must be an object", where)
    check_fields(call, frozenset({"id", "type", "function"}), where)
    if not isinstance(call.get("id"), str) or not call["id"]:
        raise bad(f"'{where}.id' must be a non-empty string", f"{where}.id")
    if call.get("type", "function") != "function":
        raise bad(f"'{where}.type' must be \"function\", got {call.get('type')!r}",
                  f"{where}.type")
    fn = check_fields(call.get("function"), frozenset({"name", "arguments"}), f"{where}.function")
    if not isinstance(fn.get("name"), str) or not fn["name"]:
        raise bad(f"'{where}.function.name' must be a non-empty string",
                  f"{where}.function.name")
    args = fn.get("arguments", "{}")
    if isinstance(args, dict):  # some clients send the object itself
        args = orjson.dumps(args).decode()
    if not isinstance(args, str):
        raise bad(f"'{where}.function.arguments' must be a JSON string",
                  f"{where}.function.arguments")
    return {"id": call["id"], "type": "function",
            "function": {"name": fn["name"], "arguments": args}}


def _reasoning(msg: dict[str, Any], where: str) -> dict[str, Any]:
    """A reply sent back as it came (`reasoning_content`, or vLLM's newer `reasoning`): kept
    for templates that render it (Qwen3's), null dropped."""
    for key in ("reasoning_content", "reasoning"):
        value = msg.get(key)
        if value is not None and not isinstance(value, str):
            raise bad(f"'{where}.{key}' must be a string or null", f"{where}.{key}")
        if value is not None:
            return {"reasoning_content": value}
    return {}


def _assistant(msg: dict[str, Any], where: str) -> dict[str, Any]:
    calls = msg.get("tool_calls")
    thought = _reasoning(msg, where)
    if calls is None or calls == []:
        content = msg.get("content")
        if content is None and thought:  # a reply cut off while thinking, sent back
            content = ""
        return {"role": "assistant", "content": _text(content, where), **thought}
    if not isinstance(calls, list):
        raise bad(f"'{where}.tool_calls' must be a list", f"{where}.tool_calls")
    content = msg.get("content")
    return {"role": "assistant", "content": "" if content is None else _text(content, where),
            "tool_calls": [_tool_call(c, f"{where}.tool_calls[{k}]")
                           for k, c in enumerate(calls)], **thought}


def parse_message(msg: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(msg, dict):
        raise bad(f"'{where}' must be an object", where)
    role = msg.get("role")
    if role not in CHAT_ROLES:
        raise bad(f"'{where}.role' must be one of {sorted(CHAT_ROLES)}, got {role!r}",
                  f"{where}.role")
    role = CHAT_ROLES[role]
    check_fields(msg, _FIELDS[role], where)
    if role == "assistant":
        return _assistant(msg, where)
    if role == "tool":
        call_id = msg.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad(f"'{where}.tool_call_id' is required in a tool message (the id of the "
                      "call it answers)", f"{where}.tool_call_id")
        return {"role": "tool", "content": _text(msg.get("content"), where),
                "tool_call_id": call_id}
    return {"role": role, "content": _text(msg.get("content"), where)}


def parse_messages(messages: Any) -> tuple[dict[str, Any], ...]:
    if not isinstance(messages, list) or not messages:
        raise bad("'messages' must be a non-empty list", "messages")
    return tuple(parse_message(m, i) for i, m in enumerate(messages))


def parse_template_options(body: dict[str, Any], roles: list[str]) -> TemplateOptions:
    """vLLM's chat extras; defaults: a generation prompt, no continuation, no kwargs."""
    agp = get_bool(body, "add_generation_prompt")
    cont = get_bool(body, "continue_final_message")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    opts = TemplateOptions(add_generation_prompt=not cont if agp is None else agp,
                           continue_final_message=bool(cont), kwargs=dict(kwargs or {}))
    opts.check_messages(roles)
    return opts
