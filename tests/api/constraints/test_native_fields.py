"""/generate's sampling_params constraint fields (SGLang's names) -> Constraint, or a 400."""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.api.protocol import parse_generate
from radixserve.constraints import Constraint, ConstraintKind
from radixserve.types import InvalidRequestError


def parse(sp: dict[str, Any]) -> Constraint | None:
    return parse_generate({"text": "hi", "sampling_params": sp}).opts.params.constraint


def test_each_field_maps_to_a_constraint() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    as_object = parse({"json_schema": schema, "max_new_tokens": 8})
    as_text = parse({"json_schema": '{"type": "object", "properties": {"a": {"type": "integer"}}}'})
    assert as_object == Constraint(ConstraintKind.JSON_SCHEMA,
                                   '{"type":"object","properties":{"a":{"type":"integer"}}}')
    assert as_text is not None and as_text.kind is ConstraintKind.JSON_SCHEMA
    assert parse({"regex": "[0-9]+"}) == Constraint(ConstraintKind.REGEX, "[0-9]+")
    assert parse({"choice": ["yes", "no", "yes"]}) == Constraint(ConstraintKind.CHOICE,
                                                                 choices=("yes", "no"))
    assert parse({"ebnf": 'root ::= "a" | "b"'}) == Constraint(ConstraintKind.EBNF,
                                                               'root ::= "a" | "b"')
    assert parse({"temperature": 0}) is None
    assert parse_generate({"text": "hi", "sampling_params": {"regex": "a+", "max_new_tokens": 5}}
                          ).opts.params.max_tokens == 5


@pytest.mark.parametrize(("sp", "param"), [
    ({"json_schema": "{oops"}, "json_schema"),
    ({"json_schema": {"type": "strin"}}, "json_schema"),
    ({"json_schema": {"not": {"type": "string"}}}, "json_schema"),
    ({"json_schema": 5}, "json_schema"),
    ({"regex": "[a-"}, "regex"),
    ({"regex": ""}, "regex"),
    ({"choice": []}, "choice"),
    ({"choice": "yes"}, "choice"),
    ({"choice": ["a", 1]}, "choice"),
    ({"ebnf": "root ::= nothing"}, "ebnf"),
    ({"regex": "a", "choice": ["a"]}, "choice"),
])
def test_bad_constraint_fields_are_400_naming_the_field(sp: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        parse(sp)
    assert info.value.status == 400
    assert info.value.param == param
