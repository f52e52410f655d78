"""Output constraints a request may carry (grammar-constrained decoding), as plain data.

Owns: the description of a constraint (what the API parsed), its stable key for the compile
cache, and the tool definitions a tool-call constraint is built from. Crosses the process
boundary inside SamplingParams, so it is torch-free and library-free.
Does not know: grammar libraries (radixserve/grammar compiles these), HTTP, tokenizers.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import xxhash


class ConstraintKind(str, enum.Enum):
    JSON_SCHEMA = "json_schema"  # text: the JSON schema, as JSON text
    JSON_OBJECT = "json_object"  # any JSON object; text unused
    REGEX = "regex"  # text: the pattern (the whole output must match)
    CHOICE = "choice"  # choices: the output is exactly one of them
    EBNF = "ebnf"  # text: a grammar in GBNF-style EBNF (SGLang's `ebnf` field)
    LARK = "lark"  # text: a grammar in Lark syntax
    TOOL_CALLS = "tool_calls"  # tool_calls: the tools, the mode and the output format


class ToolMode(str, enum.Enum):
    AUTO = "auto"  # free text, or a tool call; once the call opens, the rest is constrained
    REQUIRED = "required"  # at least one call to any of the tools, nothing else
    NAMED = "named"  # exactly the one named function (tool_choice {"type": "function", ...})


@dataclass(frozen=True)
class ToolDef:
    name: str
    parameters_json: str  # the JSON schema of the arguments, as JSON text ("{}" when absent)
    description: str = ""


@dataclass(frozen=True)
class ToolCallConstraint:
    tools: tuple[ToolDef, ...]  # for NAMED: only the named tool
    mode: ToolMode
    parallel: bool = True  # parallel_tool_calls: more than one call allowed
    call_format: str = "hermes"  # the tool-call parser's name: hermes | llama3_json


@dataclass(frozen=True)
class Constraint:
    kind: ConstraintKind
    text: str = ""
    choices: tuple[str, ...] = ()
    tool_calls: ToolCallConstraint | None = None

    @property
    def key(self) -> str:
        """Stable across processes: the compiled-grammar cache is keyed by it."""
        h = xxhash.xxh3_128()
        h.update(repr((self.kind.value, self.text, self.choices, self.tool_calls)).encode())
        return h.hexdigest()

    # Constructors for the offline API: SamplingParams(constraint=Constraint.json_schema(s)).
    # They build the same values the HTTP fields do; the engine validates them on add().

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool | str) -> Constraint:
        """JSON valid against `schema` (a schema object, or its JSON text)."""
        text = schema if isinstance(schema, str) else orjson.dumps(schema).decode()
        return cls(ConstraintKind.JSON_SCHEMA, text)

    @classmethod
    def json_object(cls) -> Constraint:
        return cls(ConstraintKind.JSON_OBJECT)

    @classmethod
    def regex(cls, pattern: str) -> Constraint:
        """The whole output matches `pattern`."""
        return cls(ConstraintKind.REGEX, pattern)

    @classmethod
    def choice(cls, options: Sequence[str]) -> Constraint:
        """The output is exactly one of `options` (duplicates dropped, order kept)."""
        return cls(ConstraintKind.CHOICE, choices=tuple(dict.fromkeys(options)))

    @classmethod
    def grammar(cls, ebnf: str) -> Constraint:
        """A grammar in GBNF-style EBNF (`root ::= ...`) or llguidance's Lark syntax."""
        return cls(ConstraintKind.EBNF, ebnf)
