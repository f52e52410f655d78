"""Chat messages (with tools, tool calls and tool results) as the chat template receives them.

Owns: the two ways tools reach the prompt.
- native: the model's template renders tools itself (it references `tools`): the messages go
  through as HF templates expect them (call arguments as objects, tool results with
  `tool_call_id` and the function `name`), and the tool list is the template's `tools`.
- fallback (templates without tool support, e.g. SmolLM2's): the tool list (one JSON object
  per line inside <tools></tools>) and an instruction in the call format of
  `--tool-call-parser` are appended to the system message (one is added when there is none);
  earlier calls are written into the assistant turn exactly as that format writes them, and
  tool results become a user turn of `<tool_response>` blocks (consecutive results share one).
Both are deterministic functions of the request, so an agent that repeats its tools and
history repeats its prompt prefix and hits the radix cache.
A request without tools, tool calls or tool results passes through unchanged.
Does not know: tokenizers (the caller applies the template), HTTP, output parsing.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from radixserve.api.tools.parsers import CallFormat
from radixserve.api.tools.tool_fields import ToolsSpec

RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"


def supports_tools(chat_template: Any) -> bool:
    """Whether the template renders a tool list itself (it reads the `tools` variable)."""
    return isinstance(chat_template, str) and "tools" in chat_template


def tools_block(spec: ToolsSpec, fmt: CallFormat) -> str:
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in spec.template_tools())
    return ("# Tools\n\nYou may call one or more of the functions below to help with the "
            "request. Each is described by a JSON object on its own line inside "
            f"<tools></tools>:\n<tools>\n{lines}\n</tools>\n\n{fmt.instruction}")


def _arguments(text: str) -> Any:
    """A call's arguments as an object (templates and formats write objects)."""
    try:
        return json.loads(text)
    except ValueError:
        return text  # not JSON: kept as the string the client sent


def _calls(msg: dict[str, Any]) -> list[tuple[str, Any, str]]:
    return [(c["function"]["name"], _arguments(c["function"]["arguments"]), c["id"])
            for c in msg.get("tool_calls", ())]


def _native(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    names: dict[str, str] = {}  # call id -> function name, for tool results
    out: list[dict[str, Any]] = []
    for msg in messages:
        if msg.get("tool_calls"):
            calls: list[dict[str, Any]] = [
                {"id": cid, "type": "function", "function": {"name": n, "arguments": a}}
                for n, a, cid in _calls(msg)]
            names.update((c["id"], c["function"]["name"]) for c in calls)
            out.append({"role": "assistant", "content": msg["content"], "tool_calls": calls,
                        **({k: msg[k] for k in ("reasoning_content",) if k in msg})})
        elif msg["role"] == "tool":
            out.append({"role": "tool", "content": msg["content"],
                        "tool_call_id": msg["tool_call_id"],
                        "name": names.get(msg["tool_call_id"], "")})
        else:
            out.append(dict(msg))
    return out


def _fallback(messages: Sequence[dict[str, Any]], spec: ToolsSpec | None,
              fmt: CallFormat) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for msg in messages:
        if msg.get("tool_calls"):
            calls = fmt.render_calls([(n, a) for n, a, _ in _calls(msg)])
            text = f"{msg['content']}\n{calls}" if msg["content"] else calls
            out.append({"role": "assistant", "content": text})
        elif msg["role"] == "tool":
            block = f"{RESPONSE_OPEN}\n{msg['content']}\n{RESPONSE_CLOSE}"
            if out and out[-1].get("tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        else:
            out.append({"role": msg["role"], "content": msg["content"]})
    out = [{"role": m["role"], "content": m["content"]} for m in out]
    if spec is not None:
        block = tools_block(spec, fmt)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def template_messages(messages: Sequence[dict[str, Any]], spec: ToolsSpec | None,
                      fmt: CallFormat, native: bool
                      ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for apply_chat_template; tools is None unless rendered natively."""
    plain = spec is None and all(m["role"] != "tool" and not m.get("tool_calls")
                                 for m in messages)
    if plain:
        return [dict(m) for m in messages], None
    if native:
        return _native(messages), None if spec is None else spec.template_tools()
    return _fallback(messages, spec, fmt), None
