"""Tool-call parsers (hermes, llama3_json): one-shot parsing and streamed delta assembly."""

from __future__ import annotations

import json
from typing import Any

import pytest

from radixserve.api.tools.parsers import (
    TOOL_CALL_FORMATS,
    ParsedOutput,
    ToolCall,
    get_format,
    parse_tool_calls,
)
from radixserve.api.tools.stream import ChatToolStream, tool_message
from radixserve.config import TOOL_CALL_PARSERS

HERMES, LLAMA3 = get_format("hermes"), get_format("llama3_json")
WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TWO = (WEATHER + '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET", '
       '"fmt": {"h": [1, 2], "s": "}{\\"<tool_call>"}}}\n</tool_call>')


def test_registry_matches_the_config_choices() -> None:
    assert tuple(TOOL_CALL_FORMATS) == TOOL_CALL_PARSERS
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        get_format("mistral")


@pytest.mark.parametrize(("fmt", "text", "expected"), [
    (HERMES, WEATHER, ParsedOutput(None, (ToolCall("get_weather", '{"city": "Paris"}'),))),
    (HERMES, TWO, ParsedOutput(None, (
        ToolCall("get_weather", '{"city": "Paris"}'),
        ToolCall("get_time", '{"tz": "CET", "fmt": {"h": [1, 2], "s": "}{\\"<tool_call>"}}'),
    ))),
    (HERMES, "Let me look.\n\n" + WEATHER,
     ParsedOutput("Let me look.", (ToolCall("get_weather", '{"city": "Paris"}'),))),
    # no arguments key -> "{}"; arguments given as a JSON string -> that string
    (HERMES, '<tool_call>{"name": "now"}</tool_call>', ParsedOutput(None, (ToolCall("now", "{}"),))),
    (HERMES, '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>',
     ParsedOutput(None, (ToolCall("f", '{"a": 1}'),))),
    # a "name" inside the arguments is an argument, not the function
    (HERMES, '<tool_call>{"arguments": {"name": "x"}, "name": "f"}</tool_call>',
     ParsedOutput(None, (ToolCall("f", '{"name": "x"}'),))),
    (LLAMA3, '{"name": "get_weather", "parameters": {"city": "Paris"}}',
     ParsedOutput(None, (ToolCall("get_weather", '{"city": "Paris"}'),))),
    (LLAMA3, '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "arguments": {}}',
     ParsedOutput(None, (ToolCall("a", '{"x": 1}'), ToolCall("b", "{}")))),
    (LLAMA3, 'Checking. <|python_tag|>{"name": "a", "parameters": {"x": [1]}}',
     ParsedOutput("Checking.", (ToolCall("a", '{"x": [1]}'),))),
])
def test_parse_calls(fmt: Any, text: str, expected: ParsedOutput) -> None:
    assert parse_tool_calls(fmt, text) == expected


@pytest.mark.parametrize(("fmt", "text"), [
    (HERMES, "The weather in Paris is sunny."),
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"x": 1,}}\n</tool_call>'),  # bad JSON
    (HERMES, '<tool_call>\n{"name": "f", "arguments": {"x": 1}'),  # cut off (max_tokens)
    (HERMES, '<tool_call>\n{"arguments": {"x": 1}}\n</tool_call>'),  # no name
    (HERMES, '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>'),  # not an object
    (HERMES, "<tool_call>\nget_weather(city='Paris')\n</tool_call>"),
    (HERMES, WEATHER + '\n<tool_call>\n{"name": "g", "arguments": {"x": }}\n</tool_call>'),
    (LLAMA3, "Paris is sunny."),
    (LLAMA3, '{"city": "Paris"}'),  # JSON, but not a call
    (LLAMA3, '{"name": "a", "parameters": {"x": 1}'),
])
def test_malformed_stays_text(fmt: Any, text: str) -> None:
    assert parse_tool_calls(fmt, text) == ParsedOutput(text, ())


def assemble(fmt: Any, text: str, step: int) -> tuple[str, list[dict[str, Any]], str | None,
                                                      list[dict[str, Any]]]:
    """Stream `text` in pieces of `step` characters; rebuild it as an OpenAI client does."""
    stream = ChatToolStream(fmt)
    deltas: list[dict[str, Any]] = []
    for i in range(0, len(text), step):
        deltas += stream.deltas(text[i:i + step], final=False)
    deltas += stream.deltas("", final=True)
    content = "".join(d.get("content", "") for d in deltas)
    calls: list[dict[str, Any]] = []
    for d in deltas:
        assert set(d) <= {"content", "tool_calls"}
        for part in d.get("tool_calls", []):
            if "id" in part:  # a new call: id, type and name come first, arguments ""
                assert part["index"] == len(calls)
                assert part["id"].startswith("call_") and part["type"] == "function"
                assert part["function"]["arguments"] == ""
                calls.append({"name": part["function"]["name"], "arguments": ""})
            else:
                assert set(part) == {"index", "function"} and part["index"] < len(calls)
                calls[part["index"]]["arguments"] += part["function"]["arguments"]
    return content, calls, stream.finish_reason("stop"), deltas


@pytest.mark.parametrize("step", [1, 2, 3, 5, 11, 1000])
@pytest.mark.parametrize(("fmt", "text"), [
    (HERMES, TWO), (HERMES, "Sure thing.  \n" + WEATHER), (HERMES, "No calls <tool here>."),
    (HERMES, '<tool_call>\n{"arguments": {"x": 1,}}\n</tool_call>'),  # broken, no name: text
    (HERMES, '<tool_call>{"arguments": {"a": "b"}, "name": "f"}</tool_call>'),
    (HERMES, "trailing space   "),
    (LLAMA3, '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'),
    (LLAMA3, "  Plain answer."), (LLAMA3, '{"city": "Paris"}'),
    (LLAMA3, 'Checking. <|python_tag|>{"name": "a", "parameters": {"x": [1]}}'),
])
def test_streamed_deltas_add_up_to_the_one_shot_parse(fmt: Any, text: str, step: int) -> None:
    content, calls, finish, _ = assemble(fmt, text, step)
    message, called = tool_message(fmt, text)
    assert (content or None) == (message["content"] or None)
    expected = [c["function"] for c in message.get("tool_calls", [])]
    assert calls == expected
    assert finish == ("tool_calls" if called else "stop")
    for call in calls:
        assert isinstance(json.loads(call["arguments"]), dict)


def test_arguments_stream_in_fragments_after_the_name() -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n'
    content, calls, _, deltas = assemble(HERMES, text + "</tool_call>", 4)
    assert content == ""
    assert calls == [{"name": "get_weather", "arguments": '{"city": "Paris", "days": 3}'}]
    fragments = [d["tool_calls"][0]["function"]["arguments"] for d in deltas
                 if "id" not in d["tool_calls"][0]]
    assert len(fragments) > 3  # arguments arrive as the model writes them, not in one piece
    assert "".join(fragments) == '{"city": "Paris", "days": 3}'


def test_text_before_a_call_streams_first_without_its_trailing_space() -> None:
    _, _, _, deltas = assemble(HERMES, "Let me check.\n" + WEATHER, 1)
    assert deltas[0] == {"content": "L"}
    assert "".join(d.get("content", "") for d in deltas) == "Let me check."
    first_call = next(i for i, d in enumerate(deltas) if "tool_calls" in d)
    assert all("content" not in d for d in deltas[first_call:])


def test_non_streaming_message_shape() -> None:
    message, called = tool_message(HERMES, "Let me look.\n" + WEATHER)
    assert called
    (call,) = message["tool_calls"]
    assert call["id"].startswith("call_") and len(call["id"]) > 10
    assert message == {"role": "assistant", "content": "Let me look.", "tool_calls": [
        {"id": call["id"], "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    assert tool_message(HERMES, "hi") == ({"role": "assistant", "content": "hi"}, False)
    ids = {tool_message(HERMES, WEATHER)[0]["tool_calls"][0]["id"] for _ in range(20)}
    assert len(ids) == 20


def test_a_call_broken_after_its_name_streamed_is_not_taken_back() -> None:
    """The documented limit of streaming (the grammar prevents it when tools are enforced)."""
    text = '<tool_call>\n{"name": "f", "arguments": {"x": 1,}}\n</tool_call>'
    content, calls, finish, _ = assemble(HERMES, text, 3)
    assert content == "" and calls == [{"name": "f", "arguments": '{"x": 1,}'}]
    assert finish == "tool_calls"
    assert tool_message(HERMES, text) == ({"role": "assistant", "content": text}, False)


def test_a_call_cut_off_after_complete_ones_is_dropped() -> None:
    cut = WEATHER + '\n<tool_call>\n{"name": "get_weather", "arguments": {"ci'
    assert parse_tool_calls(HERMES, cut) == ParsedOutput(
        None, (ToolCall("get_weather", '{"city": "Paris"}'),))
    cut = '{"name": "a", "parameters": {}}; {"name": "a", "param'
    assert parse_tool_calls(LLAMA3, cut) == ParsedOutput(None, (ToolCall("a", "{}"),))


def test_streaming_scans_each_character_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A long call (an agent writing a file) streamed token by token is not rescanned per
    token: the call scanner steps over each character once in total."""
    from radixserve.api.tools import json_scan as tool_json

    steps = 0
    real_step = tool_json.CallScanner._step

    def counting(self: tool_json.CallScanner, c: str, i: int) -> None:
        nonlocal steps
        steps += 1
        real_step(self, c, i)

    monkeypatch.setattr(tool_json.CallScanner, "_step", counting)
    body = json.dumps({"path": "a.py", "text": "x = {'a': [1, 2]}\n" * 1000})
    text = f'<tool_call>\n{{"name": "write", "arguments": {body}}}\n</tool_call>'
    content, calls, finish, _ = assemble(HERMES, text, 3)
    assert (content, finish) == ("", "tool_calls")
    assert calls == [{"name": "write", "arguments": body}]
    assert steps <= len(text)
