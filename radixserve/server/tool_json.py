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


class _Scanner:
    """One left-to-right pass over text[start:]; text[start] must be "{"."""

    def __init__(self, text: str, start: int, args_keys: tuple[str, ...]) -> None:
        assert text[start] == "{", "a call object starts with '{'"
        self.text, self.start, self.args_keys = text, start, args_keys
        self.name: str | None = None
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.key: str | None = None
        self.expect_key = True
        self.val_start = -1  # start of the top-level value being read; -1: none
        self.val_done = False

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

    def _end_string(self, str_start: int, i: int, depth: int) -> None:
        if depth != 1:
            return
        if self.expect_key:
            try:
                self.key = json.loads(self.text[str_start:i + 1])
            except ValueError:
                self.key = None
        else:
            self._finish_value(i + 1)

    def run(self) -> CallScan:
        text = self.text
        depth, in_str, escaped, str_start = 0, False, False, -1
        for i in range(self.start, len(text)):
            c = text[i]
            if in_str:
                if escaped:
                    escaped = False
                elif c == "\\":
                    escaped = True
                elif c == '"':
                    in_str = False
                    self._end_string(str_start, i, depth)
                continue
            if c == '"':
                in_str, str_start = True, i
                if depth == 1:
                    self._begin_value(i)
            elif c in "{[":
                if depth == 1:
                    self._begin_value(i)
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 1:
                    self._finish_value(i + 1)  # a nested value closed
                elif depth == 0:
                    self._finish_value(i)  # a pending number / literal ends here
                    return self._result(i + 1)
            elif depth == 1:
                self._top_level_char(c, i)
        return self._result(None)

    def _top_level_char(self, c: str, i: int) -> None:
        if c == ":":
            self.expect_key, self.val_start, self.val_done = False, -1, False
        elif c == ",":
            self._finish_value(i)
            self.expect_key, self.key = True, None
        elif not c.isspace():
            self._begin_value(i)  # a number or a literal

    def _result(self, end: int | None) -> CallScan:
        return CallScan(self.start, self.name, self.args_start, self.args_end, end)


def scan_call(text: str, start: int, args_keys: tuple[str, ...]) -> CallScan:
    """Scan the call object that begins at text[start] ("{"), complete or not."""
    return _Scanner(text, start, args_keys).run()


def skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i
