"""Tool calls in a chat response: streamed deltas and the finished message, OpenAI's shape.

Owns: ToolStreamParser (output text in, content and `delta.tool_calls[i]` pieces out: the
id, type and name first, then `function.arguments` fragments as the model writes them) and
the non-streaming `message` with `tool_calls`. Call ids are `call_<random>`.
Does not know: HTTP, the engine, how calls are formatted (parsers.py).

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

from radixserve.api.tools.json_scan import CallScan, CallScanner, skip_space
from radixserve.api.tools.parsers import CallFormat, Opening, arguments_text, parse_tool_calls

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
    """One choice's output, pushed as it is detokenized. Each character is scanned once
    (resumable call scanners, a search hint for the opening), so a long call costs O(n)."""

    def __init__(self, fmt: CallFormat) -> None:
        self._fmt = fmt
        self._text = ""
        self._sent = 0  # self._text[:_sent] went out as content
        self._search_from = 0  # no opening begins before this index
        self._opening: Opening | None = None
        self._scanners: list[CallScanner] = []  # one per call begun; only the last may be open
        self._args_sent: list[int] = []  # per call whose header went out: argument chars sent
        self._stuck = False  # a call ended without a name: nothing after it is read as calls

    @property
    def called(self) -> bool:
        return bool(self._args_sent)

    def push(self, text: str) -> StreamDelta:
        self._text += text
        if self._opening is not None:
            return StreamDelta("", self._call_deltas(final=False))
        opening = self._fmt.find_opening(self._text, self._search_from)
        if opening is None:
            # Hold back what may begin an opening, and the whitespace before it.
            end = len(self._text) - self._fmt.held_tail(self._text)
            self._search_from = end
            return StreamDelta(self._take_content(self._strip_end(end)))
        self._opening = opening
        content = self._take_content(self._strip_end(opening.content_end))
        return StreamDelta(content, self._call_deltas(final=False))

    def finish(self) -> StreamDelta:
        """End of output: what was held back, or the calls' last fragments."""
        if self.called:
            return StreamDelta("", self._call_deltas(final=True))
        return StreamDelta(self._take_content(len(self._text)))

    def _strip_end(self, end: int) -> int:
        while end > self._sent and self._text[end - 1].isspace():
            end -= 1
        return end

    def _take_content(self, end: int) -> str:
        if end <= self._sent:
            return ""
        content = self._text[self._sent:end]
        self._sent = end
        return content

    def _next_start(self) -> int | None:
        assert self._opening is not None
        if not self._scanners:
            i = skip_space(self._text, self._opening.calls_start)
            return i if self._text.startswith("{", i) else None
        end = self._scanners[-1].end
        assert end is not None
        return self._fmt.next_call(self._text, end)

    def _call_deltas(self, final: bool) -> list[CallDelta]:
        out: list[CallDelta] = []
        while not self._stuck:
            if not self._scanners or self._scanners[-1].end is not None:
                start = self._next_start()
                if start is None:
                    break
                self._scanners.append(CallScanner(start, self._fmt.args_keys))
            k = len(self._scanners) - 1
            scan = self._scanners[k].advance(self._text)
            if k == len(self._args_sent):
                if scan.name is None:  # calls go out in order: wait for this one's name
                    self._stuck = scan.done
                    break
                out.append(CallDelta(k, new_call_id(), scan.name, ""))
                self._args_sent.append(0)
            self._emit_arguments(k, scan, final or scan.done, out)
            if not scan.done:
                break
        return out

    def _emit_arguments(self, k: int, scan: CallScan, final: bool,
                        out: list[CallDelta]) -> None:
        sent, text = self._args_sent[k], self._text
        if scan.args_start is not None and text[scan.args_start] != '"':
            stop = scan.args_end if scan.args_end is not None else len(text)
            new = text[scan.args_start + sent:stop]  # only the part not sent yet
        else:  # arguments as a JSON string, or none: whole once complete
            new = arguments_text(text, scan, final)[sent:]
        if new:
            out.append(CallDelta(k, None, None, new))
            self._args_sent[k] = sent + len(new)


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
