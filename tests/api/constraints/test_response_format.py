"""`response_format` on /v1/chat/completions and /v1/completions: the three shapes become
constraints; every malformed one is a 400 naming `response_format`."""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.api.protocol import parse_chat, parse_completion
from radixserve.constraints import Constraint, ConstraintKind
from radixserve.types import InvalidRequestError

PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"]}
PERSON_TEXT = '{"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer",' \
              '"minimum":0}},"required":["name","age"]}'


def both(response_format: Any) -> list[Constraint | None]:
    chat = parse_chat({"messages": [{"role": "user", "content": "hi"}],
                       "response_format": response_format})
    completion = parse_completion({"prompt": "hi", "response_format": response_format})
    return [chat.opts.params.constraint, completion.opts.params.constraint]


@pytest.mark.parametrize(("value", "expected"), [
    (None, None),
    ({"type": "text"}, None),
    ({"type": "json_object"}, Constraint(ConstraintKind.JSON_OBJECT)),
    ({"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
     Constraint(ConstraintKind.JSON_SCHEMA, PERSON_TEXT)),
    ({"type": "json_schema", "json_schema": {"schema": PERSON, "description": "a person"}},
     Constraint(ConstraintKind.JSON_SCHEMA, PERSON_TEXT)),
])
def test_shapes(value: Any, expected: Constraint | None) -> None:
    assert both(value) == [expected, expected]


@pytest.mark.parametrize(("value", "fragment"), [
    ("json", "must be an object"),
    ({"type": "yaml"}, "yaml"),
    ({}, "'response_format.type'"),
    ({"type": "json_object", "schema": PERSON}, "unsupported field 'schema'"),
    ({"type": "text", "json_schema": {}}, "unsupported field"),
    ({"type": "json_schema"}, "'response_format.json_schema' must be an object"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "must be a JSON schema"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": "object"}}, "JSON schema"),
    ({"type": "json_schema", "json_schema": {"name": "a b", "schema": PERSON}}, "'a b'"),
    ({"type": "json_schema", "json_schema": {"schema": PERSON, "strict": "yes"}}, "boolean"),
    ({"type": "json_schema", "json_schema": {"schema": PERSON, "extra": 1}}, "'extra'"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "objct"}}}, "objct"),
    ({"type": "json_schema", "json_schema": {"schema": {"not": {"type": "string"}}}},
     "Unimplemented"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "string", "pattern": "[a-"}}},
     "regex"),
])
def test_malformed_is_a_400_naming_response_format(value: Any, fragment: str) -> None:
    for parse, body in ((parse_chat, {"messages": [{"role": "user", "content": "hi"}]}),
                        (parse_completion, {"prompt": "hi"})):
        with pytest.raises(InvalidRequestError) as info:
            parse({**body, "response_format": value})
        assert info.value.param == "response_format" and info.value.status == 400
        assert fragment in str(info.value), str(info.value)


def test_response_format_with_tools_none_is_allowed() -> None:
    tool = {"type": "function", "function": {"name": "f"}}
    req = parse_chat({"messages": [{"role": "user", "content": "hi"}], "tools": [tool],
                      "tool_choice": "none", "response_format": {"type": "json_object"}})
    assert req.opts.params.constraint == Constraint(ConstraintKind.JSON_OBJECT)
