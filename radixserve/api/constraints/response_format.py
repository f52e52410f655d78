"""The `response_format` field of /v1/chat/completions and /v1/completions.

Owns: turning OpenAI's three shapes into an output constraint, and rejecting anything else
with a 400 naming `response_format`:
  {"type": "text"}                                   -> no constraint
  {"type": "json_object"}                            -> any JSON object
  {"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}
                                                     -> JSON valid against `schema`
The schema is checked by the grammar compiler (invalid or unsupported -> 400) before the
request is queued. `strict` is accepted and changes nothing: the output is always enforced.
Does not know: grammars (radixserve/grammar), prompts (the schema is not added to the prompt,
as with vLLM and SGLang), HTTP.
"""

from __future__ import annotations

import re
from typing import Any

from radixserve.api.constraints.check import Check
from radixserve.api.fields import bad
from radixserve.constraints import Constraint

PARAM = "response_format"
SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for json_schema.name


def _only(value: dict[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(value) - allowed)
    if extra:
        raise bad(f"unsupported field '{extra[0]}' in '{where}'", PARAM)


def _json_schema(value: dict[str, Any], check: Check) -> Constraint:
    _only(value, {"type", "json_schema"}, PARAM)
    spec = value.get("json_schema")
    if not isinstance(spec, dict):
        raise bad("'response_format.json_schema' must be an object with 'name' and 'schema'",
                  PARAM)
    _only(spec, {"name", "schema", "strict", "description"}, "response_format.json_schema")
    name = spec.get("name")
    if name is not None and not (isinstance(name, str) and SCHEMA_NAME.match(name)):
        raise bad("'response_format.json_schema.name' must be 1-64 letters, digits, '_' or "
                  f"'-', got {name!r}", PARAM)
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise bad("'response_format.json_schema.strict' must be a boolean", PARAM)
    schema = spec.get("schema")
    if not isinstance(schema, (dict, bool)):
        raise bad("'response_format.json_schema.schema' must be a JSON schema (an object)",
                  PARAM)
    constraint = Constraint.json_schema(schema)
    check(constraint, PARAM)
    return constraint


def parse_response_format(value: Any, check: Check) -> Constraint | None:
    """None for free text (absent, null or {"type": "text"}); `check` validates a schema."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise bad("'response_format' must be an object with a 'type'", PARAM)
    kind = value.get("type")
    if kind == "text":
        _only(value, {"type"}, PARAM)
        return None
    if kind == "json_object":
        _only(value, {"type"}, PARAM)
        return Constraint.json_object()
    if kind == "json_schema":
        return _json_schema(value, check)
    raise bad("'response_format.type' must be \"text\", \"json_object\" or \"json_schema\", "
              f"got {kind!r}", PARAM)
