"""Parsing `tools`, `tool_choice`, `parallel_tool_calls` and tool messages; every bad input
is an InvalidRequestError (-> 400) naming its field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from radixserve.api.protocol import parse_chat
from radixserve.api.tools.tool_fields import ToolChoice
from radixserve.constraints import Constraint, ConstraintKind, ToolCallConstraint, ToolDef, ToolMode
from radixserve.types import InvalidRequestError

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string"}},
                  "required": ["city"]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                            "parameters": WEATHER_PARAMS}}
NOW = {"type": "function", "function": {"name": "now"}}
USER = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER_DEF = ToolDef("get_weather", json.dumps(WEATHER_PARAMS, separators=(",", ":")),
                      "Weather now")
NOW_DEF = ToolDef("now", '{"type":"object","properties":{}}')


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": USER, **fields}


def rejects(body: dict[str, Any], param: str, fragment: str = "") -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse_chat(body)
    assert info.value.param == param, str(info.value)
    assert info.value.status == 400
    assert fragment in str(info.value)


@pytest.mark.parametrize(("choice", "mode", "tools"), [
    (None, ToolMode.AUTO, (WEATHER_DEF, NOW_DEF)),
    ("auto", ToolMode.AUTO, (WEATHER_DEF, NOW_DEF)),
    ("required", ToolMode.REQUIRED, (WEATHER_DEF, NOW_DEF)),
    ({"type": "function", "function": {"name": "now"}}, ToolMode.NAMED, (NOW_DEF,)),
])
def test_tool_choice_becomes_a_constraint(choice: Any, mode: ToolMode,
                                          tools: tuple[ToolDef, ...]) -> None:
    body = chat(tools=[WEATHER, NOW], parallel_tool_calls=False)
    if choice is not None:
        body["tool_choice"] = choice
    req = parse_chat(body, "llama3_json")
    assert req.opts.params.constraint == Constraint(
        ConstraintKind.TOOL_CALLS,
        tool_calls=ToolCallConstraint(tools, mode, parallel=False, call_format="llama3_json"))
    assert req.tools is not None and req.tools.tools == (WEATHER_DEF, NOW_DEF)
    assert req.tools.parses_calls


def test_tool_choice_none_renders_tools_without_a_constraint() -> None:
    req = parse_chat(chat(tools=[WEATHER], tool_choice="none"))
    assert req.opts.params.constraint is None
    assert req.tools is not None and req.tools.choice is ToolChoice.NONE
    assert not req.tools.parses_calls
    assert req.tools.template_tools() == [WEATHER]


def test_no_tools() -> None:
    for body in (chat(), chat(tools=[]), chat(tool_choice="none"), chat(tools=None)):
        req = parse_chat(body)
        assert req.tools is None and req.opts.params.constraint is None
    assert parse_chat(chat(tools=[WEATHER])).tools.parallel is True  # type: ignore[union-attr]


def test_history_with_tool_calls_and_results() -> None:
    messages = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "21C"}]},
    ]
    req = parse_chat({"messages": messages, "tools": [WEATHER]})
    assert req.messages == (
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "content": "21C", "tool_call_id": "call_1"},
    )


BAD_SCHEMA = {"type": "function", "function": {"name": "f", "parameters": {"type": "objct"}}}
UNSUPPORTED = {"type": "function",
               "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}


@pytest.mark.parametrize(("fields", "param", "fragment"), [
    ({"tools": [BAD_SCHEMA]}, "tools[0].function.parameters", "objct"),
    ({"tools": [WEATHER, UNSUPPORTED]}, "tools[1].function.parameters", "Unimplemented"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     "tools[0].function.parameters", "JSON schema"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type", "retrieval"),
    ({"tools": [{"type": "code_interpreter", "function": {"name": "f"}}]}, "tools[0].type", ""),
    ({"tools": [{"type": "function"}]}, "tools[0].function", "JSON object"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name", "bad name!"),
    ({"tools": [{"type": "function", "function": {"description": "x"}}]},
     "tools[0].function.name", ""),
    ({"tools": [{"type": "function", "function": {"name": "f", "description": 3}}]},
     "tools[0].function.description", ""),
    ({"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]}, "extra", ""),
    ({"tools": [WEATHER, WEATHER]}, "tools", "more than once"),
    ({"tools": {"get_weather": WEATHER}}, "tools", ""),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope'"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "always"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice", ""),
    ({"tools": [WEATHER], "tool_choice": {"function": {"name": "get_weather"}}}, "tool_choice",
     ""),
    ({"tool_choice": "required"}, "tool_choice", "only allowed when 'tools'"),
    ({"tool_choice": "auto"}, "tool_choice", "only allowed when 'tools'"),
    ({"tools": [], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice", ""),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls", ""),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "cannot be combined"),
])
def test_bad_tools_are_named(fields: dict[str, Any], param: str, fragment: str) -> None:
    rejects(chat(**fields), param, fragment)


CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(("message", "param"), [
    ({"role": "tool", "content": "21C"}, "messages[1].tool_call_id"),
    ({"role": "tool", "content": "21C", "tool_call_id": ""}, "messages[1].tool_call_id"),
    ({"role": "tool", "tool_call_id": "call_1"}, "messages[1].content"),
    ({"role": "assistant", "content": None}, "messages[1].content"),
    ({"role": "assistant", "tool_calls": {"id": "x"}}, "messages[1].tool_calls"),
    ({"role": "assistant", "tool_calls": [{**CALL, "id": None}]}, "messages[1].tool_calls[0].id"),
    ({"role": "assistant", "tool_calls": [{**CALL, "type": "code"}]},
     "messages[1].tool_calls[0].type"),
    ({"role": "assistant", "tool_calls": [{"id": "c", "type": "function"}]},
     "messages[1].tool_calls[0].function"),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "", "arguments": "{}"}}]},
     "messages[1].tool_calls[0].function.name"),
    ({"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": 3}}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"role": "user", "content": "x", "tool_calls": [CALL]}, "tool_calls"),
    ({"role": "function", "content": "x", "name": "f"}, "messages[1].role"),
])
def test_bad_tool_messages_are_named(message: dict[str, Any], param: str) -> None:
    rejects({"messages": [*USER, message]}, param)


def test_arguments_sent_as_an_object_are_kept_as_json_text() -> None:
    call = {**CALL, "function": {"name": "f", "arguments": {"a": 1}}}
    req = parse_chat({"messages": [*USER, {"role": "assistant", "tool_calls": [call]}]})
    assert req.messages[1]["tool_calls"][0]["function"]["arguments"] == '{"a":1}'


def test_schema_checks_are_remembered_per_server(monkeypatch: pytest.MonkeyPatch) -> None:
    """An agent sends the same tools every turn: each schema is compiled once, not per
    request; a bad one is still a 400 every time."""
    from radixserve.api.constraints import check as constraint_check

    compiled: list[str] = []
    real = constraint_check.check_constraint

    def counting(constraint: Constraint, param: str, allow_additional: bool = False) -> None:
        compiled.append(constraint.text)
        real(constraint, param, allow_additional)

    monkeypatch.setattr(constraint_check, "check_constraint", counting)
    checker = constraint_check.ConstraintChecker(capacity=2)
    for _ in range(3):
        parse_chat(chat(tools=[WEATHER, NOW]), check=checker)
    assert compiled == [WEATHER_DEF.parameters_json, NOW_DEF.parameters_json]
    for _ in range(2):
        with pytest.raises(InvalidRequestError):
            parse_chat(chat(tools=[BAD_SCHEMA]), check=checker)
    assert len(compiled) == 4 and len(checker) == 2
    fmt = {"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}}
    parse_chat(chat(response_format=fmt), check=checker)  # evicts the oldest (capacity 2)
    parse_chat(chat(tools=[WEATHER]), check=checker)
    assert compiled[4:] == ['{"type":"integer"}', WEATHER_DEF.parameters_json]
