"""Incremental detokenization and stop-string matching for streamed output.

Owns: IncrementalDetokenizer (token ids in, text deltas out, never a broken UTF-8 character)
and StopMatcher (stop strings that may span tokens: honoured, never emitted).
Does not know: HTTP, the engine, sampling.

Why a window: decoding one token at a time loses context-dependent text (SentencePiece's
leading-space marker, byte-level BPE pieces of one multi-byte character). So we decode a short
window twice, `ids[prefix:read]` and `ids[prefix:]`, and emit the difference. Layout:

    ids:   ... | prefix_offset ......... read_offset ......... len(ids)
                 \\__ already emitted __/ \\____ pending ______/

When the longer decode ends in U+FFFD the pending tokens end inside a character: emit nothing
and wait for more tokens (flush() emits whatever is left when the stream ends).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple, Protocol

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens kept as left context for the first output token
MAX_PENDING_TOKENS = 6  # a UTF-8 character is <= 4 bytes; past this the U+FFFD is real


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Decoder, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def push(self, token_id: int) -> str:
        """Add one token; return the newly complete text (possibly "")."""
        self._ids.append(token_id)
        return self._advance(final=False)

    def flush(self) -> str:
        """End of stream: emit the pending text even if it ends inside a character."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if not final:
            if len(full_text) <= len(prefix_text):
                return ""  # e.g. a skipped special token: nothing visible yet
            incomplete = full_text.endswith(REPLACEMENT_CHAR)
            if incomplete and len(self._ids) - self._read_offset < MAX_PENDING_TOKENS:
                return ""
        # NOTE: slicing by length assumes decode(prefix window) is a prefix of decode(full
        # window), which holds for byte-level BPE and SentencePiece outside rare normalizations.
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta


class StopResult(NamedTuple):
    text: str  # text that is safe to emit now
    stopped: bool  # a stop string was found; `text` ends just before it


class StopMatcher:
    """Holds back the longest tail that could still grow into a stop string."""

    def __init__(self, stop: Sequence[str]) -> None:
        self._stop = tuple(stop)
        self._max_len = max((len(s) for s in self._stop), default=0)
        self._pending = ""

    def push(self, text: str, final: bool = False) -> StopResult:
        if not self._stop:
            return StopResult(text, False)
        buf = self._pending + text
        first = min((i for i in (buf.find(s) for s in self._stop) if i >= 0), default=-1)
        if first >= 0:
            self._pending = ""
            return StopResult(buf[:first], True)
        hold = 0 if final else self._held_suffix_len(buf)
        self._pending = buf[len(buf) - hold :]
        return StopResult(buf[: len(buf) - hold], False)

    def _held_suffix_len(self, buf: str) -> int:
        for length in range(min(len(buf), self._max_len - 1), 0, -1):
            tail = buf[-length:]
            if any(s.startswith(tail) for s in self._stop):
                return length
        return 0
