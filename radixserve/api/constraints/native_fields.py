"""Native /generate's constraint fields in `sampling_params`, with SGLang's names.

Owns: `json_schema` (a JSON-schema object or its JSON text), `regex` (string), `choice` (list
of strings), `ebnf` (string): at most one, mapped to a Constraint and validated with
check_constraint, so a bad one is a 400 naming the field before anything is queued.
`constraint_of` reads one such value; extra.py uses it for the OpenAI routes.
Does not know: the engine, tokenizers, HTTP.
"""

from __future__ import annotations

from typing import Any

from radixserve.api.constraints.check import Check
from radixserve.api.fields import bad
from radixserve.constraints import Constraint
from radixserve.grammar.validate import check_constraint

NATIVE_CONSTRAINT_FIELDS = ("json_schema", "regex", "choice", "ebnf")
MAX_CHOICES = 1024


def _string(value: Any, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise bad(f"'{param}' must be a non-empty string", param)
    return value


def parse_native_constraint(sp: dict[str, Any], check: Check = check_constraint
                            ) -> Constraint | None:
    """The constraint a /generate `sampling_params` asks for, validated; None when none."""
    given = [f for f in NATIVE_CONSTRAINT_FIELDS if sp.get(f) is not None]
    if not given:
        return None
    if len(given) > 1:
        raise bad(f"at most one of {', '.join(NATIVE_CONSTRAINT_FIELDS)} may be given, got "
                  f"{' and '.join(given)}", given[1])
    return constraint_of(given[0], sp[given[0]], given[0], check)


def constraint_of(kind: str, value: Any, param: str, check: Check = check_constraint
                  ) -> Constraint:
    """`value` read as the native field `kind` (one of NATIVE_CONSTRAINT_FIELDS), validated;
    errors name `param`, the field as the client spelled it."""
    if kind == "json_schema":
        schema = value if isinstance(value, (dict, bool)) else _string(value, param)
        constraint = Constraint.json_schema(schema)
    elif kind == "regex":
        constraint = Constraint.regex(_string(value, param))
    elif kind == "ebnf":
        constraint = Constraint.grammar(_string(value, param))
    else:
        assert kind == "choice", kind
        if not (isinstance(value, list) and value and all(isinstance(s, str) and s for s in value)):
            raise bad(f"'{param}' must be a non-empty list of non-empty strings", param)
        if len(value) > MAX_CHOICES:
            raise bad(f"'{param}' holds at most {MAX_CHOICES} strings, got {len(value)}", param)
        constraint = Constraint.choice(value)
    check(constraint, param)
    return constraint
