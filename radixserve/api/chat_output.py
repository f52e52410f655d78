"""A chat choice's output read back: reasoning first, then tool calls in what remains.

Owns: per choice, how output text becomes streamed `delta` objects (`reasoning_content`,
`content`, `tool_calls`) and the finished `message`; the order (vLLM's) is that reasoning is
split off first and only the content after it is read for tool calls, so a call written while
thinking is not called. Does not know: HTTP, chunks and usage (server/routes/chat.py), the
formats themselves (api/reasoning.py, api/tools/).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.api.reasoning import ReasoningFormat, ReasoningSplitter, split_reasoning
from radixserve.api.tools.parsers import CallFormat
from radixserve.api.tools.stream import TOOL_CALLS_FINISH, ChatToolStream, tool_message


@dataclass(frozen=True)
class OutputReading:
    """How one request's output is read: its call format (None: no tools parsed) and its
    reasoning format (None: no --reasoning-parser, or thinking turned off)."""

    calls: CallFormat | None = None
    reasoning: ReasoningFormat | None = None
    prompt_opened: bool = False  # the rendered prompt ends inside an open <think>
    # The server has a reasoning parser: messages carry reasoning_content (null when none,
    # as when the request turned thinking off), as vLLM's do.
    reasoning_field: bool = False


class ChoiceReader:
    """One streamed choice: text in, `delta` objects out."""

    def __init__(self, reading: OutputReading) -> None:
        self._tools = ChatToolStream(reading.calls) if reading.calls else None
        self._splitter = (ReasoningSplitter(reading.reasoning, reading.prompt_opened)
                          if reading.reasoning else None)

    def deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        reasoning, content = "", text
        if self._splitter is not None:
            part = self._splitter.push(text, final)
            reasoning, content = part.reasoning, part.content
        out: list[dict[str, Any]] = [{"reasoning_content": reasoning}] if reasoning else []
        if self._tools is not None:
            out.extend(self._tools.deltas(content, final))
        elif content:
            out.append({"content": content})
        return out

    def finish_reason(self, engine_reason: str | None) -> str | None:
        return self._tools.finish_reason(engine_reason) if self._tools else engine_reason


def chat_message(reading: OutputReading, text: str) -> tuple[dict[str, Any], bool]:
    """A finished choice's `message`, and whether it called tools. With a reasoning parser the
    message always has `reasoning_content` (null when the model did not think), and content
    is null when nothing followed the thinking (vLLM's shape)."""
    reasoning, content = None, text
    if reading.reasoning is not None:
        reasoning, content = split_reasoning(reading.reasoning, reading.prompt_opened, text)
    if reading.calls is not None:
        message, called = tool_message(reading.calls, content)
    else:
        message, called = {"role": "assistant", "content": content}, False
    if reading.reasoning is not None or reading.reasoning_field:
        if reasoning is not None and not message["content"]:
            message["content"] = None
        message["reasoning_content"] = reasoning
    return message, called


def finish_of(called: bool, engine_reason: str | None) -> str | None:
    """A finished choice's finish_reason: tool_calls when it called, else the engine's."""
    return TOOL_CALLS_FINISH if called and engine_reason else engine_reason
