"""vLLM's and SGLang's extra constraint fields on the OpenAI routes (sent through the openai
SDK's `extra_body`): each maps to the same constraint as the native field; bad ones are a 400
naming the field as the client spelled it; one constraint per request."""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.api.protocol import parse_chat, parse_completion
from radixserve.constraints import Constraint, ConstraintKind
from radixserve.types import InvalidRequestError

MESSAGES = [{"role": "user", "content": "hi"}]
SCHEMA_TEXT = '{"type":"object","properties":{"ok":{"type":"boolean"}}}'
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}}
GRAMMAR = 'root ::= "yes" | "no"'


def both(extra: dict[str, Any]) -> list[Constraint | None]:
    chat = parse_chat({"messages": MESSAGES, **extra})
    completion = parse_completion({"prompt": "hi", **extra})
    return [chat.opts.params.constraint, completion.opts.params.constraint]


@pytest.mark.parametrize(("extra", "expected"), [
    ({"guided_json": SCHEMA}, Constraint(ConstraintKind.JSON_SCHEMA, SCHEMA_TEXT)),
    ({"guided_json": SCHEMA_TEXT}, Constraint(ConstraintKind.JSON_SCHEMA, SCHEMA_TEXT)),
    ({"guided_regex": "[0-9]{3}"}, Constraint(ConstraintKind.REGEX, "[0-9]{3}")),
    ({"guided_choice": ["a", "b", "a"]}, Constraint(ConstraintKind.CHOICE, choices=("a", "b"))),
    ({"guided_grammar": GRAMMAR}, Constraint(ConstraintKind.EBNF, GRAMMAR)),
    ({"structured_outputs": {"json": SCHEMA}},
     Constraint(ConstraintKind.JSON_SCHEMA, SCHEMA_TEXT)),
    ({"structured_outputs": {"regex": "x+"}}, Constraint(ConstraintKind.REGEX, "x+")),
    ({"structured_outputs": {"choice": ["yes"]}},
     Constraint(ConstraintKind.CHOICE, choices=("yes",))),
    ({"structured_outputs": {"grammar": GRAMMAR}}, Constraint(ConstraintKind.EBNF, GRAMMAR)),
    ({"regex": "x+"}, Constraint(ConstraintKind.REGEX, "x+")),
    ({"ebnf": GRAMMAR}, Constraint(ConstraintKind.EBNF, GRAMMAR)),
    ({"guided_json": SCHEMA, "guided_decoding_backend": "xgrammar",
      "guided_whitespace_pattern": " "}, Constraint(ConstraintKind.JSON_SCHEMA, SCHEMA_TEXT)),
    ({"guided_json": None, "structured_outputs": None}, None),
])
def test_fields_map_to_constraints(extra: dict[str, Any], expected: Constraint | None) -> None:
    assert both(extra) == [expected, expected]


@pytest.mark.parametrize(("extra", "param"), [
    ({"guided_json": {"type": "object", "not": {}}}, "guided_json"),
    ({"guided_json": ""}, "guided_json"),
    ({"guided_regex": "(unclosed"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": "a"}, "guided_choice"),
    ({"guided_grammar": "root ::= undefined_rule"}, "guided_grammar"),
    ({"structured_outputs": {"regex": "(x"}}, "structured_outputs.regex"),
    ({"structured_outputs": {"json_object": True}}, "structured_outputs"),
    ({"structured_outputs": "json"}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"regex": "a", "structured_outputs": {"regex": "b"}}, "structured_outputs.regex"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_fields_are_400_naming_them(extra: dict[str, Any], param: str) -> None:
    for parse in (lambda: parse_chat({"messages": MESSAGES, **extra}),
                  lambda: parse_completion({"prompt": "hi", **extra})):
        with pytest.raises(InvalidRequestError) as err:
            parse()
        assert err.value.param == param


def test_with_tools_only_when_tool_choice_is_none() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(InvalidRequestError) as err:
        parse_chat({"messages": MESSAGES, "tools": tools, "guided_regex": "x"})
    assert err.value.param == "response_format"
    req = parse_chat({"messages": MESSAGES, "tools": tools, "tool_choice": "none",
                      "guided_regex": "x"})
    assert req.opts.params.constraint == Constraint(ConstraintKind.REGEX, "x")
