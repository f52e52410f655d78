"""What a JSON field may hold: typed getters, the unsupported-field policy, token-id lists.

Owns: the field policy (so that nothing that would change the output is silently dropped):
- the caller's supported fields are parsed and validated by the caller;
- IGNORED_FIELDS never change the generated tokens and are accepted and ignored:
  user, metadata, store, service_tier, parallel_tool_calls;
- NEUTRAL_ONLY fields are accepted only at their no-op value (best_of 1, suffix "",
  response_format {"type": "text"}, tools [], tool_choice "none", ...);
- every other field is rejected with 400 naming it.
Does not know: which fields a route supports (protocol.py says), HTTP, the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from radixserve.types import InvalidRequestError

IGNORED_FIELDS = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})
NEUTRAL_ONLY: dict[str, Callable[[Any], bool]] = {
    "best_of": lambda v: v in (None, 1),
    "suffix": lambda v: v in (None, ""),
    "response_format": lambda v: v is None or v == {"type": "text"},
    "tools": lambda v: v in (None, []),
    "tool_choice": lambda v: v in (None, "none"),
    "functions": lambda v: v in (None, []),
    "function_call": lambda v: v in (None, "none"),
    "modalities": lambda v: v is None or v == ["text"],
}

def bad(message: str, param: str | None) -> InvalidRequestError:
    return InvalidRequestError(message, param=param)


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def get_int(body: dict[str, Any], name: str, lo: int | None = None, hi: int | None = None,
            param: str | None = None) -> int | None:
    """The integer field `name`, or None when absent or null."""
    value = body.get(name)
    param = param or name
    if value is None:
        return None
    if not is_int(value):
        raise bad(f"'{param}' must be an integer, got {type(value).__name__}", param)
    if lo is not None and value < lo:
        raise bad(f"'{param}' must be >= {lo}, got {value}", param)
    if hi is not None and value > hi:
        raise bad(f"'{param}' must be <= {hi}, got {value}", param)
    return int(value)


def get_float(body: dict[str, Any], name: str, param: str | None = None) -> float | None:
    value = body.get(name)
    param = param or name
    if value is None:
        return None
    if not (isinstance(value, (int, float)) and not isinstance(value, bool)):
        raise bad(f"'{param}' must be a number, got {type(value).__name__}", param)
    return float(value)


def get_bool(body: dict[str, Any], name: str, param: str | None = None) -> bool | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bool):
        param = param or name
        raise bad(f"'{param}' must be a boolean, got {type(value).__name__}", param)
    return value


def check_fields(body: Any, allowed: frozenset[str], where: str | None = None) -> dict[str, Any]:
    """Reject a non-object body and any field outside the policy in the module docstring.

    `where` names the nested object being checked (None: the request body itself).
    """
    place = "" if where is None else f" in '{where}'"
    if not isinstance(body, dict):
        raise bad(f"'{where}' must be a JSON object" if where else
                  "the request body must be a JSON object", where)
    for name, value in body.items():
        if name in allowed or name in IGNORED_FIELDS:
            continue
        neutral = NEUTRAL_ONLY.get(name)
        if neutral is not None and neutral(value):
            continue
        raise bad(f"unsupported parameter '{name}'{place}: this server does not implement it",
                  name)
    return body


def parse_token_ids(value: Any, param: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not all(is_int(x) for x in value):
        raise bad(f"'{param}' must be a list of integers", param)
    if any(x < 0 for x in value):
        raise bad(f"'{param}' must hold non-negative token ids", param)
    return tuple(value)
