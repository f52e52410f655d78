"""Constraint -> llguidance grammar text (torch-free, tokenizer-free).

Owns: the grammar each ConstraintKind means, including tool-call grammars (Hermes and
Llama-3 JSON call formats; modes required, named and auto). Raises ValueError for input that
cannot even be turned into a grammar (not JSON, empty choice list); whether the grammar is
valid is decided by llguidance (validate.py, backend.py).
JSON schemas (response formats, tool arguments) are closed first (closed_objects.py: an object
generates only the properties it names) unless `allow_additional_properties`, the server's
--structured-outputs-allow-additional-properties, restores the JSON Schema default.
Does not know: tokenizers, torch, HTTP, requests.

Tool-call output formats (what the tool-call parsers read back):
- hermes: `<tool_call>\n{"name": "<fn>", "arguments": {...}}\n</tool_call>`, several calls
  separated by "\n" when parallel.
- llama3_json: `{"name": "<fn>", "parameters": {...}}`, several separated by "; ".
Mode auto (hermes): free text; once the model writes `<tool_call>` the rest is calls. Mode
auto (llama3_json): free text that does not start with "{", or calls. Mode named is exactly one
call whatever `parallel` says (as vLLM's named tool choice): the grammar then only allows the
end of the output, so a model that would repeat the call cannot.
"""

from __future__ import annotations

import json
from typing import Any

from llguidance import LLMatcher, grammar_from

from radixserve.constraints import Constraint, ConstraintKind, ToolCallConstraint, ToolMode
from radixserve.grammar.closed_objects import close_objects

# Compact, single-spaced JSON, as models write it; no free whitespace (a weak model given
# free whitespace can spin in it until max_tokens).
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
}
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
LLAMA3_SEPARATOR = "; "


def parse_schema(text: str) -> dict[str, Any] | bool:
    """The JSON schema in `text`; ValueError when it is not JSON or not an object/boolean."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"the JSON schema is not valid JSON: {err}") from None
    if not isinstance(schema, (dict, bool)):
        raise ValueError("a JSON schema must be an object (or a boolean)")
    return schema


def _with_options(schema: dict[str, Any] | bool) -> dict[str, Any] | bool:
    if isinstance(schema, bool):
        return schema
    return {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}


def _schema(text: str, allow_additional_properties: bool) -> dict[str, Any] | bool:
    schema = parse_schema(text)
    return schema if allow_additional_properties else close_objects(schema)


def grammar_text(c: Constraint, allow_additional_properties: bool = False) -> str:
    """The llguidance grammar (its serialized top-level form) for a constraint."""
    k = c.kind
    if k is ConstraintKind.JSON_SCHEMA:
        schema = _schema(c.text, allow_additional_properties)
        return LLMatcher.grammar_from_json_schema(json.dumps(_with_options(schema)))
    if k is ConstraintKind.JSON_OBJECT:
        return LLMatcher.grammar_from_json_schema(json.dumps(_with_options({"type": "object"})))
    if k is ConstraintKind.REGEX:
        return LLMatcher.grammar_from_regex(c.text)
    if k is ConstraintKind.CHOICE:
        if not c.choices:
            raise ValueError("the choice list is empty")
        if any(not s for s in c.choices):
            raise ValueError("a choice must not be the empty string")
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in c.choices))
    if k is ConstraintKind.EBNF:
        return grammar_from("ebnf", c.text)
    if k is ConstraintKind.LARK:
        return LLMatcher.grammar_from_lark(c.text)
    if k is ConstraintKind.TOOL_CALLS:
        assert c.tool_calls is not None, "a tool_calls constraint carries its tools"
        return LLMatcher.grammar_from_lark(
            tool_call_lark(c.tool_calls, allow_additional_properties))
    raise AssertionError(f"unhandled constraint kind {k}")


def _call_schema(name: str, parameters_json: str, args_key: str,
                 allow_additional_properties: bool) -> dict[str, Any]:
    params = _schema(parameters_json or "{}", allow_additional_properties)
    if params == {} or params is True:
        params = {"type": "object"}
    return {
        "type": "object",
        "properties": {"name": {"const": name}, args_key: params},
        "required": ["name", args_key],
        "additionalProperties": False,
    }


def tool_call_lark(tc: ToolCallConstraint, allow_additional_properties: bool = False) -> str:
    """A Lark grammar (llguidance dialect) for the calls a request may make."""
    if not tc.tools:
        raise ValueError("a tool-call constraint needs at least one tool")
    if tc.mode is ToolMode.NAMED and len(tc.tools) != 1:
        raise ValueError("a named tool choice carries exactly one tool")
    hermes = tc.call_format == "hermes"
    if not hermes and tc.call_format != "llama3_json":
        raise ValueError(f"unknown tool-call format {tc.call_format!r}")
    args_key = "arguments" if hermes else "parameters"
    several = tc.parallel and tc.mode is not ToolMode.NAMED
    lines = ["%llguidance {}"]
    fns = []
    for i, tool in enumerate(tc.tools):
        schema = _with_options(_call_schema(tool.name, tool.parameters_json, args_key,
                                            allow_additional_properties))
        lines.append(f"fn_{i}: %json {json.dumps(schema)}")
        fns.append(f"fn_{i}")
    lines.append("fn: " + " | ".join(fns))
    if hermes:
        lines.append(f'call_body: "\\n" fn "\\n{HERMES_CLOSE}"')
        lines.append(f'call: "{HERMES_OPEN}" call_body')
        more = '("\\n" call)*' if several else ""
        if tc.mode is ToolMode.AUTO:
            # The lazy lexeme ends at the first "<tool_call>": text before it is free, the
            # call after it is constrained. TEXT alone is the no-call answer.
            lines.append("TEXT: /(.|\\n)*/")
            lines.append(f'opened[lazy]: TEXT "{HERMES_OPEN}"')
            lines.append(f"start: TEXT | opened call_body {more}")
        else:
            lines.append(f"start: call {more}")
    else:
        more = f'("{LLAMA3_SEPARATOR}" fn)*' if several else ""
        if tc.mode is ToolMode.AUTO:
            lines.append("TEXT: /([^{](.|\\n)*)?/")
            lines.append(f"start: TEXT | fn {more}")
        else:
            lines.append(f"start: fn {more}")
    return "\n".join(lines) + "\n"
