"""Tool calls in a chat response: streamed deltas and the finished message, OpenAI's shape.

Owns: ToolStreamParser (output text in, content and `delta.tool_calls[i]` pieces out: the
id, type and name first, then `function.arguments` fragments as the model writes them) and
the non-streaming `message` with `tool_calls`. Call ids are `call_<random>`.
Does not know: HTTP, the engine, how calls are formatted (tool_parsers.py).

Consistency with the one-shot parse: content is the text before the first call (trailing
whitespace dropped; held back while it may still precede a call), and the streamed argument
fragments concatenate to exactly the non-streaming `arguments`. When the output opens a call
but no call name ever completes, everything from the opening streams as content at the end,
as the one-shot parse returns it as text. (A call whose JSON breaks after its name streamed
cannot be taken back; the engine's grammar prevents that for tool_choice auto/required/named.
Nor can a last call cut off by max_tokens: its partial arguments went out, while the
non-streaming message drops it.)
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from radixserve.server.tool_parsers import (
    CallFormat,
    Opening,
    arguments_text,
    parse_tool_calls,
    scan_calls,
)

TOOL_CALLS_FINISH = "tool_calls"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class CallDelta:
    index: int
    id: str | None  # set (with the name) on a call's first delta only
    name: str | None
    arguments: str

    def wire(self) -> dict[str, Any]:
        if self.id is None:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class StreamDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class ToolStreamParser:
    """One choice's output, pushed as it is detokenized."""

    def __init__(self, fmt: CallFormat) -> None:
        self._fmt = fmt
        self._text = ""
        self._sent = 0  # self._text[:_sent] went out as content
        self._opening: Opening | None = None
        self._args_sent: list[int] = []  # per call whose header went out: argument chars sent

    @property
    def called(self) -> bool:
        return bool(self._args_sent)

    def push(self, text: str) -> StreamDelta:
        self._text += text
        if self._opening is None:
            opening = self._fmt.find_opening(self._text)
            if opening is None:
                # Hold back what may begin an opening, and the whitespace before it.
                safe = self._text[:len(self._text) - self._fmt.held_tail(self._text)]
                return StreamDelta(self._take_content(len(safe.rstrip())))
            self._opening = opening
            content = self._text[self._sent:opening.content_end].rstrip()
            self._sent += len(content)
            return StreamDelta(content, self._call_deltas(final=False))
        return StreamDelta("", self._call_deltas(final=False))

    def finish(self) -> StreamDelta:
        """End of output: what was held back, or the calls' last fragments."""
        if self.called:
            return StreamDelta("", self._call_deltas(final=True))
        return StreamDelta(self._take_content(len(self._text)))

    def _take_content(self, end: int) -> str:
        if end <= self._sent:
            return ""
        content = self._text[self._sent:end]
        self._sent = end
        return content

    def _call_deltas(self, final: bool) -> list[CallDelta]:
        assert self._opening is not None
        out: list[CallDelta] = []
        scans = scan_calls(self._fmt, self._text, self._opening.calls_start)
        for k, scan in enumerate(scans):
            if k == len(self._args_sent):
                if scan.name is None:
                    break  # calls go out in order: wait for this one's name
                out.append(CallDelta(k, new_call_id(), scan.name, ""))
                self._args_sent.append(0)
            args = arguments_text(self._text, scan, final=final or scan.done)
            if len(args) > self._args_sent[k]:
                out.append(CallDelta(k, None, None, args[self._args_sent[k]:]))
                self._args_sent[k] = len(args)
        return out


class ChatToolStream:
    """Per choice of a streaming chat request with tools: text in, `delta` objects out."""

    def __init__(self, fmt: CallFormat) -> None:
        self._parser = ToolStreamParser(fmt)

    def deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        step = self._parser.push(text)
        if final:
            end = self._parser.finish()
            step = StreamDelta(step.content + end.content, step.calls + end.calls)
        out: list[dict[str, Any]] = [{"content": step.content}] if step.content else []
        out.extend({"tool_calls": [c.wire()]} for c in step.calls)
        return out

    def finish_reason(self, engine_reason: str | None) -> str | None:
        if engine_reason is not None and self._parser.called:
            return TOOL_CALLS_FINISH
        return engine_reason


def tool_message(fmt: CallFormat, text: str) -> tuple[dict[str, Any], bool]:
    """The non-streaming `message` for a finished output, and whether it holds calls."""
    parsed = parse_tool_calls(fmt, text)
    if not parsed.calls:
        return {"role": "assistant", "content": text}, False
    calls = [{"id": new_call_id(), "type": "function",
              "function": {"name": c.name, "arguments": c.arguments}} for c in parsed.calls]
    return {"role": "assistant", "content": parsed.content, "tool_calls": calls}, True
