"""An incremental scan of one tool-call JSON object: `{"name": ..., "arguments": {...}}`.

Owns: finding, in a possibly unfinished object, the function name (once its string is
complete) and the exact source text of the arguments value (growing as the model writes it),
without a full JSON parse. Both the streaming and the one-shot tool-call parsers use it, so a
call's `arguments` string is the same byte-for-byte in both.
Does not know: call formats (tags, separators), OpenAI's wire format, tool schemas.

Only top-level keys count (depth 1): a "name" inside the arguments is an argument.
"""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class CallScan:
    """What is known of one call object so far. `end` is set once the object's `}` is seen."""

    start: int  # index of the object's "{"
    name: str | None
    args_start: int | None  # index in the text where the arguments value begins
    args_end: int | None  # exclusive end of the arguments value, once it is complete
    end: int | None  # index just past the object's closing brace

    @property
    def done(self) -> bool:
        return self.end is not None


class CallScanner:
    """A left-to-right pass over one call object that starts at text[start] ("{").

    Resumable: `advance(text)` continues where the previous call stopped, so a streamed
    output is scanned once in total, not once per token. Every `text` passed must extend the
    previous one (append-only), as a detokenized stream does.
    """

    def __init__(self, start: int, args_keys: tuple[str, ...]) -> None:
        self.start, self.args_keys = start, args_keys
        self.text = ""
        self.pos = start  # next character to read
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.end: int | None = None
        self.key: str | None = None
        self.expect_key = True
        self.val_start = -1  # start of the top-level value being read; -1: none
        self.val_done = False
        self.depth, self.in_str, self.escaped, self.str_start = 0, False, False, -1

    def _finish_value(self, end: int) -> None:
        if self.val_start < 0 or self.val_done:
            return
        self.val_done = True
        value = self.text[self.val_start:end].rstrip()
        if self.key == "name" and value.startswith('"'):
            try:
                decoded = json.loads(value)
            except ValueError:
                decoded = None
            self.name = decoded if isinstance(decoded, str) else None
        elif self.key in self.args_keys and self.args_start == self.val_start:
            self.args_end = self.val_start + len(value)

    def _begin_value(self, i: int) -> None:
        if self.val_start < 0 and not self.expect_key:
            self.val_start = i
            if self.key in self.args_keys and self.args_start is None:
                self.args_start = i

    def _end_string(self, i: int) -> None:
        if self.depth != 1:
            return
        if self.expect_key:
            try:
                self.key = json.loads(self.text[self.str_start:i + 1])
            except ValueError:
                self.key = None
        else:
            self._finish_value(i + 1)

    def advance(self, text: str) -> CallScan:
        assert text[self.start] == "{", "a call object starts with '{'"
        self.text = text
        i = self.pos
        while self.end is None and i < len(text):
            self._step(text[i], i)
            i += 1
        self.pos = i
        return CallScan(self.start, self.name, self.args_start, self.args_end, self.end)

    def _step(self, c: str, i: int) -> None:
        if self.in_str:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == '"':
                self.in_str = False
                self._end_string(i)
        elif c == '"':
            self.in_str, self.str_start = True, i
            if self.depth == 1:
                self._begin_value(i)
        elif c in "{[":
            if self.depth == 1:
                self._begin_value(i)
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 1:
                self._finish_value(i + 1)  # a nested value closed
            elif self.depth == 0:
                self._finish_value(i)  # a pending number / literal ends here
                self.end = i + 1
        elif self.depth == 1:
            self._top_level_char(c, i)

    def _top_level_char(self, c: str, i: int) -> None:
        if c == ":":
            self.expect_key, self.val_start, self.val_done = False, -1, False
        elif c == ",":
            self._finish_value(i)
            self.expect_key, self.key = True, None
        elif not c.isspace():
            self._begin_value(i)  # a number or a literal


def scan_call(text: str, start: int, args_keys: tuple[str, ...]) -> CallScan:
    """Scan the call object that begins at text[start] ("{"), complete or not."""
    return CallScanner(start, args_keys).advance(text)


def skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i
