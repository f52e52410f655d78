"""Tool-call output formats (`--tool-call-parser`): how a model writes calls, read back.

Owns: the registry of call formats (hermes, llama3_json) and, per format, where the calls
begin in the output, what separates two calls, the fallback prompt instruction that asks for
that format, and how a call in the history is written back; plus the one-shot parse of a
finished output into content and calls. Streaming lives in stream.py on the same pieces.
Does not know: HTTP, OpenAI's wire format, tool schemas (the grammar enforces them).

Formats (the engine's tool-call grammars write exactly these; see radixserve/grammar):
- hermes (Qwen2.5, Hermes, many others): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n
  </tool_call>`, one block per call; text before the first block is content.
- llama3_json (Llama 3.1/3.2): `{"name": ..., "parameters": {...}}`, calls separated by "; ";
  the output is calls when it starts with "{" (or after a `<|python_tag|>`).
A malformed call (bad JSON, no name, arguments not an object) leaves the whole output as text;
a last call cut off (max_tokens) after complete ones is dropped (a weak model given
parallel_tool_calls may repeat calls until the limit).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NamedTuple

from radixserve.api.tools.json_scan import CallScan, scan_call, skip_space


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # None when the output is only calls
    calls: tuple[ToolCall, ...]


class Opening(NamedTuple):
    content_end: int  # text[:content_end] is content (right-stripped when calls follow)
    calls_start: int  # the first call object is at or after this index


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class CallFormat:
    """One output format. Subclasses set the class attributes and the two scanners."""

    name: str = ""
    args_keys: tuple[str, ...] = ()
    args_key: str = ""  # the key this format writes (history, instruction)
    instruction: str = ""  # fallback prompt text, after the tool list

    def find_opening(self, text: str, start: int = 0) -> Opening | None:
        """Where calls begin; `start`: no opening begins before it (a streaming hint)."""
        raise NotImplementedError

    def held_tail(self, text: str) -> int:
        """How many trailing characters might still become an opening (not content yet)."""
        raise NotImplementedError

    def next_call(self, text: str, after: int) -> int | None:
        """Index of the next call's "{" after a call that ended at `after`; None if none."""
        raise NotImplementedError

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        """Calls (name, arguments object) as the model would have written them."""
        raise NotImplementedError

    def call_json(self, name: str, arguments: Any) -> str:
        return json.dumps({"name": name, self.args_key: arguments}, ensure_ascii=False)


class HermesFormat(CallFormat):
    name = "hermes"
    args_keys = ("arguments",)
    args_key = "arguments"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    instruction = (
        "To call a function, reply with one <tool_call></tool_call> block per call, each "
        "holding a JSON object with the function's name and its arguments:\n"
        '<tool_call>\n{"name": "<function name>", "arguments": {<arguments as JSON>}}\n'
        "</tool_call>"
    )

    def find_opening(self, text: str, start: int = 0) -> Opening | None:
        at = text.find(self.OPEN, start)
        return None if at < 0 else Opening(at, at + len(self.OPEN))

    def held_tail(self, text: str) -> int:
        return _held_prefix(text, self.OPEN)

    def next_call(self, text: str, after: int) -> int | None:
        i = skip_space(text, after)
        if text.startswith(self.CLOSE, i):
            i = skip_space(text, i + len(self.CLOSE))
        if not text.startswith(self.OPEN, i):
            return None
        i = skip_space(text, i + len(self.OPEN))
        return i if text.startswith("{", i) else None

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return "\n".join(f"{self.OPEN}\n{self.call_json(n, a)}\n{self.CLOSE}" for n, a in calls)


class Llama3JsonFormat(CallFormat):
    name = "llama3_json"
    args_keys = ("parameters", "arguments")
    args_key = "parameters"
    TAG, SEPARATOR = "<|python_tag|>", "; "
    instruction = (
        "To call a function, reply with only a JSON object holding the function's name and "
        'its parameters, {"name": "<function name>", "parameters": {<arguments as JSON>}}; '
        'to make several calls, separate the objects with "; ".'
    )

    def find_opening(self, text: str, start: int = 0) -> Opening | None:
        first = skip_space(text, 0)
        if text.startswith("{", first):
            return Opening(0, first)
        at = text.find(self.TAG, start)
        return None if at < 0 else Opening(at, at + len(self.TAG))

    def held_tail(self, text: str) -> int:
        if not text.strip():
            return len(text)  # a "{" may still come first
        return _held_prefix(text, self.TAG)

    def next_call(self, text: str, after: int) -> int | None:
        i = skip_space(text, after)
        if text.startswith(";", i):
            i = skip_space(text, i + 1)
        return i if text.startswith("{", i) else None

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return self.SEPARATOR.join(self.call_json(n, a) for n, a in calls)


TOOL_CALL_FORMATS: Mapping[str, CallFormat] = MappingProxyType(
    {f.name: f for f in (HermesFormat(), Llama3JsonFormat())}
)


def get_format(name: str) -> CallFormat:
    fmt = TOOL_CALL_FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {sorted(TOOL_CALL_FORMATS)}")
    return fmt


def scan_calls(fmt: CallFormat, text: str, start: int) -> list[CallScan]:
    """Every call object from `start` on; the last one may be unfinished."""
    scans: list[CallScan] = []
    i: int | None = skip_space(text, start)
    while i is not None and text.startswith("{", i):
        scan = scan_call(text, i, fmt.args_keys)
        scans.append(scan)
        if scan.end is None:
            break
        i = fmt.next_call(text, scan.end)
    return scans


def arguments_text(text: str, scan: CallScan, final: bool) -> str:
    """The arguments of `scan` as OpenAI sends them (JSON text); partial unless `final`.

    The model's own text is kept (so streamed fragments add up to exactly this). Arguments
    written as a JSON string are decoded once complete; missing arguments are "{}".
    """
    if scan.args_start is None:
        return "{}" if final and scan.done else ""
    value = text[scan.args_start:scan.args_end if scan.args_end is not None else len(text)]
    if value.startswith('"'):
        if scan.args_end is None:
            return ""
        try:
            decoded = json.loads(value)
        except ValueError:
            return value
        return decoded if isinstance(decoded, str) else value
    return value


def _valid_call(text: str, scan: CallScan) -> ToolCall | None:
    if not scan.done or not scan.name:
        return None
    args = arguments_text(text, scan, final=True)
    try:
        parsed = json.loads(args)
    except ValueError:
        return None
    if not isinstance(parsed, dict):
        return None
    try:  # the whole object must be JSON too (no trailing commas, no junk between keys)
        json.loads(text[scan.start:scan.end])
    except ValueError:
        return None
    return ToolCall(scan.name, args)


def parse_tool_calls(fmt: CallFormat, text: str) -> ParsedOutput:
    """A finished output: calls (all valid) and the text before them, or only text."""
    opening = fmt.find_opening(text)
    if opening is None:
        return ParsedOutput(text, ())
    calls = []
    scans = scan_calls(fmt, text, opening.calls_start)
    if len(scans) > 1 and not scans[-1].done:
        scans.pop()  # cut off by max_tokens after complete calls: keep those
    for scan in scans:
        call = _valid_call(text, scan)
        if call is None:
            return ParsedOutput(text, ())
        calls.append(call)
    if not calls:
        return ParsedOutput(text, ())
    content = text[:opening.content_end].rstrip()
    return ParsedOutput(content or None, tuple(calls))
