"""Constraint fields of vLLM and SGLang clients on the OpenAI routes (`guided_json`, ...).

Besides `response_format`, these come through the openai SDK's `extra_body`.

Owns: mapping them to the native kinds of native.py, at most one per request:
  vLLM (<= 0.9, still common):   guided_json, guided_regex, guided_choice, guided_grammar
  vLLM (>= 0.10):                structured_outputs = {"json" | "regex" | "choice" | "grammar"}
  SGLang:                        regex, ebnf
`guided_grammar` / `structured_outputs.grammar` / `ebnf` are all read as the native `ebnf`
(llguidance's Lark-style grammar; GBNF `::=` rules are accepted too). vLLM's
`guided_decoding_backend` and `guided_whitespace_pattern` are accepted and ignored: there is one
backend, and whitespace follows the grammar's default.
Does not know: grammars, tools, HTTP.
"""

from __future__ import annotations

from typing import Any

from radixserve.api.constraints.check import Check
from radixserve.api.constraints.native_fields import constraint_of
from radixserve.api.fields import bad
from radixserve.constraints import Constraint

# body field -> native kind
_TOP_LEVEL = {"guided_json": "json_schema", "guided_regex": "regex", "guided_choice": "choice",
              "guided_grammar": "ebnf", "regex": "regex", "ebnf": "ebnf"}
# structured_outputs.<key> -> native kind
_STRUCTURED = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "ebnf"}
IGNORED_FIELDS = frozenset({"guided_decoding_backend", "guided_whitespace_pattern"})
EXTRA_CONSTRAINT_FIELDS = frozenset(_TOP_LEVEL) | {"structured_outputs"} | IGNORED_FIELDS


def _given(body: dict[str, Any]) -> list[tuple[str, str, Any]]:
    """(param as spelled, native kind, value) for every constraint field that is set."""
    given = [(f, kind, body[f]) for f, kind in _TOP_LEVEL.items() if body.get(f) is not None]
    structured = body.get("structured_outputs")
    if structured is not None:
        if not isinstance(structured, dict):
            raise bad("'structured_outputs' must be an object", "structured_outputs")
        unknown = sorted(set(structured) - set(_STRUCTURED))
        if unknown:
            raise bad(f"unsupported field '{unknown[0]}' in 'structured_outputs' (supported: "
                      f"{', '.join(_STRUCTURED)})", "structured_outputs")
        given += [(f"structured_outputs.{k}", kind, structured[k])
                  for k, kind in _STRUCTURED.items() if structured.get(k) is not None]
    return given


def parse_extra_constraint(body: dict[str, Any], check: Check) -> Constraint | None:
    """The constraint these fields ask for, validated (400 naming the field); None if none."""
    given = _given(body)
    if not given:
        return None
    if len(given) > 1:
        raise bad(f"at most one output constraint may be given, got "
                  f"{' and '.join(p for p, _, _ in given)}", given[1][0])
    param, kind, value = given[0]
    return constraint_of(kind, value, param, check)
