"""The reasoning split (api/reasoning.py) and its order with tool calls (api/chat_output.py):
whole outputs as vLLM's qwen3 / deepseek_r1 parsers read them, and the same split whatever
the pieces a stream delivers the text in."""

from __future__ import annotations

import json

import pytest

from radixserve.api.chat_output import ChoiceReader, OutputReading, chat_message
from radixserve.api.reasoning import (
    ReasoningSplitter,
    get_reasoning_format,
    prompt_opens_thinking,
    split_reasoning,
    thinking_enabled,
)
from radixserve.api.tools.parsers import get_format

QWEN3 = get_reasoning_format("qwen3")
R1 = get_reasoning_format("deepseek_r1")

CASES = [  # (format, prompt opened <think>, output, reasoning, content)
    (QWEN3, False, "<think>\nLet me see.\n</think>\n\nParis.", "\nLet me see.\n", "\n\nParis."),
    (QWEN3, False, "\n<think>a</think>b", "a", "b"),
    (QWEN3, False, "Paris.", None, "Paris."),  # thinking off: no tags in the output
    (QWEN3, False, "Paris </think> is", None, "Paris </think> is"),
    (QWEN3, False, "The <think> tag", None, "The <think> tag"),  # only at the start
    (QWEN3, True, "hmm</think>Paris.", "hmm", "Paris."),  # Qwen3-Thinking-2507's template
    (QWEN3, False, "<think>cut off by max_tok", "cut off by max_tok", ""),
    (QWEN3, False, "<thi", None, "<thi"),  # not the tag after all
    (QWEN3, False, "", None, ""),
    (R1, True, "ponder</think>\n\n42", "ponder", "\n\n42"),
    (R1, True, "<think>ponder</think>42", "ponder", "42"),  # R1-0528 writes the tag too
    (R1, False, "ponder</think>42", "ponder", "42"),  # R1 starts untagged
    (R1, True, "still pondering", "still pondering", ""),  # max_tokens inside the thinking
    (R1, True, "ponder</think>", "ponder", ""),
]


@pytest.mark.parametrize(("fmt", "opened", "text", "reasoning", "content"), CASES)
def test_split_whole_and_in_every_piece_size(fmt, opened, text, reasoning, content) -> None:
    assert split_reasoning(fmt, opened, text) == (reasoning, content)
    for size in range(1, len(text) + 1):
        splitter = ReasoningSplitter(fmt, opened)
        pieces = [text[i:i + size] for i in range(0, len(text), size)] or [""]
        parts = [splitter.push(p, final=k == len(pieces) - 1) for k, p in enumerate(pieces)]
        assert "".join(p.reasoning for p in parts) == (reasoning or "")
        assert "".join(p.content for p in parts) == content
        assert splitter.reasoned == (reasoning is not None)


def test_held_tag_prefix_is_released_when_it_is_not_the_tag() -> None:
    splitter = ReasoningSplitter(R1, True)
    assert splitter.push("a</th").reasoning == "a"
    assert splitter.push("orn").reasoning == "</thorn"


def test_prompt_opens_thinking_and_thinking_switches() -> None:
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_thinking("assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_thinking("<|im_start|>assistant\n")
    assert thinking_enabled({}) and thinking_enabled({"enable_thinking": True})
    assert not thinking_enabled({"enable_thinking": False})
    assert not thinking_enabled({"thinking": False})
    with pytest.raises(ValueError, match="supported: qwen3, deepseek_r1"):
        get_reasoning_format("nope")


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


def test_calls_are_read_after_the_reasoning_only() -> None:
    reading = OutputReading(get_format("hermes"), QWEN3, False)
    message, called = chat_message(reading, f"<think>\nI should call.\n</think>\n\n{CALL}")
    assert called and message["reasoning_content"] == "\nI should call.\n"
    assert message["content"] is None
    [call] = message["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris"}
    # A call written while thinking is thinking, not a call.
    message, called = chat_message(reading, f"<think>{CALL}</think>Sunny.")
    assert not called and message["content"] == "Sunny." and message["reasoning_content"] == CALL


def test_streamed_deltas_match_the_whole_message() -> None:
    reading = OutputReading(get_format("hermes"), QWEN3, False)
    text = f"<think>\nhmm\n</think>\n\n{CALL}"
    reader = ChoiceReader(reading)
    deltas = [d for i in range(0, len(text), 3)
              for d in reader.deltas(text[i:i + 3], i + 3 >= len(text))]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "\nhmm\n"
    args = "".join(c["function"].get("arguments") or "" for d in deltas
                   for c in d.get("tool_calls", []))
    assert json.loads(args) == {"city": "Paris"}
    assert reader.finish_reason("stop") == "tool_calls"
    assert chat_message(OutputReading(), "<think>x</think>y") == (
        {"role": "assistant", "content": "<think>x</think>y"}, False)  # no parser: as is
