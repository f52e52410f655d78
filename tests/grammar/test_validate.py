"""check_constraint: bad constraints are a 400 naming the field; the module stays torch-free."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from radixserve.constraints import Constraint, ConstraintKind, ToolCallConstraint, ToolDef, ToolMode
from radixserve.grammar.validate import check_constraint
from radixserve.types import InvalidRequestError

WEATHER = json.dumps({"type": "object", "properties": {"city": {"type": "string"}},
                      "required": ["city"]})


def test_validate_does_not_import_torch() -> None:
    code = ("import sys; import radixserve.grammar.validate as v; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("constraint", [
    Constraint(ConstraintKind.JSON_SCHEMA, WEATHER),
    Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "array", "items": {"enum": [1, 2]}}'),
    Constraint(ConstraintKind.JSON_OBJECT),
    Constraint(ConstraintKind.REGEX, r"\d{3}-[a-z]+"),
    Constraint(ConstraintKind.CHOICE, choices=("yes", "no")),
    Constraint(ConstraintKind.EBNF, 'root ::= "yes" | "no"'),
    Constraint(ConstraintKind.LARK, 'start: "a"+'),
    Constraint(ConstraintKind.TOOL_CALLS, tool_calls=ToolCallConstraint(
        (ToolDef("get_weather", WEATHER), ToolDef("now", "{}")), ToolMode.AUTO)),
    Constraint(ConstraintKind.TOOL_CALLS, tool_calls=ToolCallConstraint(
        (ToolDef("get_weather", WEATHER),), ToolMode.NAMED, call_format="llama3_json")),
])
def test_valid_constraints_pass(constraint: Constraint) -> None:
    check_constraint(constraint, "x")


@pytest.mark.parametrize(("constraint", "fragment"), [
    (Constraint(ConstraintKind.JSON_SCHEMA, "{not json"), "not valid JSON"),
    (Constraint(ConstraintKind.JSON_SCHEMA, "[1, 2]"), "must be an object"),
    (Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "objct"}'), "objct"),
    (Constraint(ConstraintKind.JSON_SCHEMA, '{"not": {"type": "string"}}'), "Unimplemented"),
    (Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "string", "pattern": "[a-"}'), "regex"),
    (Constraint(ConstraintKind.REGEX, "[a-z"), "unclosed character class"),
    (Constraint(ConstraintKind.CHOICE, choices=()), "empty"),
    (Constraint(ConstraintKind.EBNF, "root ::= missing_rule"), "missing_rule"),
    (Constraint(ConstraintKind.LARK, 'start: "a" nowhere'), "nowhere"),
    (Constraint(ConstraintKind.TOOL_CALLS, tool_calls=ToolCallConstraint(
        (ToolDef("f", '{"type": "object", "not": {}}'),), ToolMode.REQUIRED)), "Unimplemented"),
])
def test_invalid_constraints_name_the_field(constraint: Constraint, fragment: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        check_constraint(constraint, "response_format")
    assert info.value.param == "response_format"
    assert info.value.status == 400
    assert fragment in str(info.value)
