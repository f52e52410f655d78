"""What every config shares: ConfigError, and reading a JSON-valued flag.

Owns: the error a bad setting raises and the flag-value -> mapping rule. Does not know: any
one config's fields.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any


class ConfigError(ValueError):
    """A setting is invalid; the message names it and what is allowed."""


def json_object_from(value: object, what: str) -> Mapping[str, Any]:
    """A config flag's value as a mapping: the mapping itself, or its JSON text parsed (vLLM's
    JSON-valued flags and the offline API's dicts). Raises ConfigError naming `what`."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ConfigError(f"{what} is not valid JSON: {err}") from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"{what} must be a JSON object")
    return value
