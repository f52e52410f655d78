"""Reject a bad constraint before the request is queued (the API process calls this).

Owns: check_constraint, which raises InvalidRequestError naming the request field for an
invalid JSON schema, an unsupported schema feature, a regex that does not compile, a bad
grammar or a bad tool list. Torch-free (llguidance's core is a Rust extension without torch);
it validates without a tokenizer, so the engine can still fail later on tokenizer-specific
limits (that request then gets its own 400, never a stalled batch).
Does not know: tokenizers, the engine, HTTP.
"""

from __future__ import annotations

from llguidance import LLMatcher

from radixserve.constraints import Constraint
from radixserve.grammar.grammar_text import grammar_text
from radixserve.types import InvalidRequestError

_WHAT = {
    "json_schema": "JSON schema", "json_object": "JSON object", "regex": "regex",
    "choice": "choice list", "ebnf": "EBNF grammar", "lark": "Lark grammar",
    "tool_calls": "tool definitions",
}


def check_constraint(constraint: Constraint, param: str,
                     allow_additional_properties: bool = False) -> None:
    """Raise InvalidRequestError(param=param) unless the constraint compiles (as the engine
    will compile it: closed or open objects, grammar_text.py)."""
    what = _WHAT[constraint.kind.value]
    try:
        grammar = grammar_text(constraint, allow_additional_properties)
    except ValueError as err:
        raise InvalidRequestError(f"invalid {what}: {err}", param=param) from None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_error:
        detail = messages[0].strip() if messages else "rejected by the grammar compiler"
        raise InvalidRequestError(f"invalid {what}: {detail}", param=param)
