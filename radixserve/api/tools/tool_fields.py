"""The `tools`, `tool_choice` and `parallel_tool_calls` fields of a chat request.

Owns: validating them (every error names its field: `tools[i].function.parameters`,
`tool_choice`, ...) into a ToolsSpec, and the output constraint each tool_choice means:
  none     -> no constraint, no parsing (the tools are still shown to the model, as OpenAI does)
  auto     -> ToolMode.AUTO: text, or calls that the grammar constrains once opened
  required -> ToolMode.REQUIRED: one or more calls to any tool, nothing else
  {"type": "function", "function": {"name": N}} -> ToolMode.NAMED: exactly one call, to N
Does not know: prompts (prompt.py), output parsing (parsers.py), HTTP.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any

import orjson

from radixserve.api.constraints.check import Check
from radixserve.api.fields import bad, check_fields, get_bool
from radixserve.constraints import Constraint, ConstraintKind, ToolCallConstraint, ToolDef, ToolMode

FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule, plus "."


class ToolChoice(str, enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class ToolsSpec:
    tools: tuple[ToolDef, ...]
    choice: ToolChoice
    named: str | None  # the function of ToolChoice.NAMED
    parallel: bool

    @property
    def parses_calls(self) -> bool:
        """Whether the output is read back for calls (never with tool_choice none)."""
        return self.choice is not ToolChoice.NONE

    def constraint(self, call_format: str) -> Constraint | None:
        if self.choice is ToolChoice.NONE:
            return None
        tools = self.tools
        if self.choice is ToolChoice.NAMED:
            tools = tuple(t for t in self.tools if t.name == self.named)
        mode = ToolMode(self.choice.value)
        return Constraint(ConstraintKind.TOOL_CALLS, tool_calls=ToolCallConstraint(
            tools, mode, parallel=self.parallel, call_format=call_format))

    def template_tools(self) -> list[dict[str, Any]]:
        """The tool list in OpenAI's request shape, which chat templates also take."""
        out = []
        for t in self.tools:
            fn: dict[str, Any] = {"name": t.name}
            if t.description:
                fn["description"] = t.description
            fn["parameters"] = orjson.loads(t.parameters_json)
            out.append({"type": "function", "function": fn})
        return out


def _tool(value: Any, i: int, check: Check) -> ToolDef:
    where = f"tools[{i}]"
    check_fields(value, frozenset({"type", "function"}), where)
    if value.get("type") != "function":
        raise bad(f"'{where}.type' must be \"function\" (the only tool type supported), got "
                  f"{value.get('type')!r}", f"{where}.type")
    fn = check_fields(value.get("function"),
                      frozenset({"name", "description", "parameters", "strict"}),
                      f"{where}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        raise bad(f"'{where}.function.name' must be 1-64 letters, digits, '_', '-' or '.', "
                  f"got {name!r}", f"{where}.function.name")
    description = fn.get("description") or ""
    if not isinstance(description, str):
        raise bad(f"'{where}.function.description' must be a string",
                  f"{where}.function.description")
    get_bool(fn, "strict", f"{where}.function.strict")  # accepted: calls are always enforced
    params = fn.get("parameters")
    param = f"{where}.function.parameters"
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise bad(f"'{param}' must be a JSON schema object", param)
    parameters_json = orjson.dumps(params).decode()
    check(Constraint(ConstraintKind.JSON_SCHEMA, parameters_json), param)
    return ToolDef(name, parameters_json, description)


def _choice(value: Any, names: set[str]) -> tuple[ToolChoice, str | None]:
    if value is None:
        return ToolChoice.AUTO, None
    if isinstance(value, str):
        if value not in ("none", "auto", "required"):
            raise bad(f"'tool_choice' must be \"none\", \"auto\", \"required\" or "
                      f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got {value!r}",
                      "tool_choice")
        return ToolChoice(value), None
    check_fields(value, frozenset({"type", "function"}), "tool_choice")
    fn = value.get("function")
    if value.get("type") != "function" or not isinstance(fn, dict):
        raise bad("'tool_choice' as an object must be {\"type\": \"function\", \"function\": "
                  "{\"name\": ...}}", "tool_choice")
    check_fields(fn, frozenset({"name"}), "tool_choice.function")
    name = fn.get("name")
    if name not in names:
        raise bad(f"'tool_choice' names the function {name!r}, which is not in 'tools' "
                  f"({', '.join(sorted(names))})", "tool_choice")
    return ToolChoice.NAMED, name


def parse_tools(body: dict[str, Any], check: Check) -> ToolsSpec | None:
    """None when the request has no tools (then tool_choice may only be "none").

    `check` validates each tool's parameter schema (raises InvalidRequestError).
    """
    parallel = get_bool(body, "parallel_tool_calls")
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise bad("'tool_choice' is only allowed when 'tools' are given", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad("'tools' must be a list of {\"type\": \"function\", \"function\": {...}}",
                  "tools")
    defs = tuple(_tool(t, i, check) for i, t in enumerate(tools))
    names = [d.name for d in defs]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup is not None:
        raise bad(f"'tools' defines the function {dup!r} more than once", "tools")
    mode, named = _choice(choice, set(names))
    return ToolsSpec(defs, mode, named, True if parallel is None else parallel)
