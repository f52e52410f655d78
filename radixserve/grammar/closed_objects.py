"""Closing JSON schemas: objects generate only the properties they name (xgrammar's default).

Owns: close_objects, the rewrite every constrained path applies before a schema becomes a
grammar, unless the server runs with --structured-outputs-allow-additional-properties. JSON
Schema lets an object carry any property it does not name; vLLM's default backend (xgrammar)
does not generate them, and clients are written against that: a small model left free to add
properties may add them until max_tokens (instructor's Mode.TOOLS with a plain pydantic model).
Does not know: grammars, llguidance, requests.

Rule: an object schema that lists `properties` and says nothing about other properties (no
`additionalProperties`, `patternProperties` or `unevaluatedProperties`) gets
`"additionalProperties": false`. Left as they are, because closing them would change what
the schema means rather than what it leaves open:
  - an object without `properties` (`{"type": "object"}`: any object, as xgrammar does);
  - a schema combined with others by intersection (a member of `allOf`, or a schema with
    `allOf` or `$ref` beside its own keywords): closing each part would reject the other
    parts' properties;
  - anything under `not`, `if`/`then`/`else` or `dependentSchemas`.
The walk goes into properties, items, definitions and the `anyOf`/`oneOf`/`allOf` branches.
"""

from __future__ import annotations

from typing import Any

_OPEN_KEYS = ("additionalProperties", "patternProperties", "unevaluatedProperties")
_INTERSECTING = ("allOf", "$ref")
_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
_LISTS = ("anyOf", "oneOf", "prefixItems")  # [schema]
_SINGLE = ("additionalProperties", "additionalItems", "contains", "unevaluatedProperties")

Schema = dict[str, Any] | bool


def close_objects(schema: Schema) -> Schema:
    """A copy of `schema` closed as the module docstring says; `schema` is not modified."""
    closed: Schema = _close(schema, intersected=False)
    return closed


def _close(schema: Any, intersected: bool) -> Any:
    if not isinstance(schema, dict):
        return schema  # true / false, or a malformed value llguidance reports itself
    out = dict(schema)
    for key in _MAPS:
        value = out.get(key)
        if isinstance(value, dict):
            out[key] = {name: _close(sub, False) for name, sub in value.items()}
    for key in _LISTS:
        value = out.get(key)
        if isinstance(value, list):
            out[key] = [_close(sub, False) for sub in value]
    for key in _SINGLE:
        if isinstance(out.get(key), dict):
            out[key] = _close(out[key], False)
    items = out.get("items")
    if isinstance(items, list):  # draft 4-7 tuple form
        out["items"] = [_close(sub, False) for sub in items]
    elif isinstance(items, dict):
        out["items"] = _close(items, False)
    members = out.get("allOf")
    if isinstance(members, list):
        out["allOf"] = [_close(sub, True) for sub in members]
    names_properties = isinstance(out.get("properties"), dict)
    says_nothing = not any(key in out for key in _OPEN_KEYS)
    combined = intersected or any(key in out for key in _INTERSECTING)
    if names_properties and says_nothing and not combined:
        out["additionalProperties"] = False
    return out
