"""Reasoning output (`--reasoning-parser`): a model's `<think>...</think>` split from its answer.

Owns: the registry of reasoning formats (qwen3, deepseek_r1), whether a request thinks at all
(`chat_template_kwargs` turning it off), whether the rendered prompt already opened the
thinking block, and the incremental split of output text into reasoning and content (one
splitter serves streamed chunks and whole outputs alike, so both modes agree).
Does not know: HTTP, OpenAI's wire format, tool calls (the content part goes to those).

The rules (vLLM's parsers, made to agree between streamed and whole responses):
- Text inside `<think>`...`</think>` is reasoning; the tags themselves are dropped.
- A template that opens `<think>` in the prompt (DeepSeek-R1's, Qwen3-Thinking-2507's) leaves
  only `</think>` in the output: everything before it is reasoning. deepseek_r1 also treats an
  output with no tags at all as reasoning (R1 starts thinking without writing the tag).
- qwen3 treats output as content unless it opens with `<think>` (after whitespace) or the
  prompt left one open; `enable_thinking: false` renders a closed, empty block in the prompt.
- Output cut off (max_tokens) inside the thinking is all reasoning; content is then null.
- `chat_template_kwargs` `{"enable_thinking": false}` (or `{"thinking": false}`) turns the
  split off: the whole output is content.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    reasons_by_default: bool  # untagged output is reasoning (until the end tag)


_FORMATS = {"qwen3": ReasoningFormat("qwen3", False),
            "deepseek_r1": ReasoningFormat("deepseek_r1", True)}
REASONING_PARSERS = tuple(_FORMATS)


def get_reasoning_format(name: str) -> ReasoningFormat:
    if name not in _FORMATS:
        raise ValueError(f"unknown reasoning parser {name!r}; supported: "
                         f"{', '.join(REASONING_PARSERS)}")
    return _FORMATS[name]


def thinking_enabled(template_kwargs: Mapping[str, Any]) -> bool:
    """False when the request turned thinking off (Qwen3's `enable_thinking`, DeepSeek's
    `thinking`); anything else leaves it on."""
    return template_kwargs.get("enable_thinking") is not False \
        and template_kwargs.get("thinking") is not False


def prompt_opens_thinking(prompt_tail: str) -> bool:
    """The rendered prompt's end (decoded, special tokens kept) has an unclosed `<think>`."""
    return prompt_tail.rfind(THINK_START) > prompt_tail.rfind(THINK_END)


def _held_prefix(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class _Phase(enum.Enum):
    START = "start"  # nothing decided yet: whitespace, or a part of `<think>`, so far
    REASONING = "reasoning"
    CONTENT = "content"


@dataclass(frozen=True)
class Split:
    reasoning: str
    content: str


class ReasoningSplitter:
    """Feeds output text in pieces; each push returns the reasoning and content it releases
    (a piece that may be the start of a tag is held until the next push or the last)."""

    def __init__(self, fmt: ReasoningFormat, prompt_opened: bool) -> None:
        self._default = _Phase.REASONING if fmt.reasons_by_default or prompt_opened \
            else _Phase.CONTENT
        self._phase = _Phase.START
        self._held = ""
        self.reasoned = False  # some text was (or is being) read as reasoning

    def push(self, text: str, final: bool = False) -> Split:
        buf, self._held = self._held + text, ""
        reasoning: list[str] = []
        if self._phase is _Phase.START:
            buf = self._start(buf, final)
        if self._phase is _Phase.REASONING:
            end = buf.find(THINK_END)
            if end >= 0:
                reasoning.append(buf[:end])
                buf = buf[end + len(THINK_END):]
                self._phase = _Phase.CONTENT
            else:
                keep = 0 if final else _held_prefix(buf, THINK_END)
                reasoning.append(buf[:len(buf) - keep])
                self._held, buf = buf[len(buf) - keep:], ""
        content = buf if self._phase is _Phase.CONTENT else ""
        return Split("".join(reasoning), content)

    def _start(self, buf: str, final: bool) -> str:
        """Decide the phase once the output's first non-space text shows whether it opens
        with `<think>`; returns what the decided phase reads (all of `buf`, less the tag)."""
        stripped = buf.lstrip()
        if stripped.startswith(THINK_START):
            self._enter(_Phase.REASONING)
            return stripped[len(THINK_START):]
        if not final and THINK_START.startswith(stripped):  # "" or a part of the tag
            self._held = buf
            return ""
        self._enter(self._default)
        return buf

    def _enter(self, phase: _Phase) -> None:
        self._phase = phase
        self.reasoned = self.reasoned or phase is _Phase.REASONING


def split_reasoning(fmt: ReasoningFormat, prompt_opened: bool,
                    text: str) -> tuple[str | None, str]:
    """A whole output: (reasoning or None when there was none, content)."""
    splitter = ReasoningSplitter(fmt, prompt_opened)
    part = splitter.push(text, final=True)
    return (part.reasoning if splitter.reasoned else None), part.content
