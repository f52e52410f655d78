"""What every config shares: ConfigError, reading a JSON-valued flag and a byte size.

Owns: the error a bad setting raises, the flag-value -> mapping rule and the "4G" -> bytes
rule. Does not know: any
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


# vLLM's human-readable sizes: lower case suffixes are powers of 1000, upper case of 1024.
_SIZE_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
                  "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_byte_size(value: object, what: str) -> int:
    """An int, or text such as "512M", "1.5G", "2000000" -> bytes. Raises ConfigError naming
    `what` for anything else (a bool, a negative or fractional byte count, a bad suffix)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if not isinstance(value, str):
        raise ConfigError(f"{what} must be an int or text like 512M / 4G, got {value!r}")
    text = value.strip()
    factor = _SIZE_SUFFIXES.get(text[-1:], 1)
    number = text[:-1] if factor != 1 else text
    try:
        amount = float(number) * factor
    except ValueError:
        raise ConfigError(f"{what}: cannot read {value!r} as a byte size (e.g. 512M, 4G, "
                          f"1000000)") from None
    if amount != int(amount) or amount < 0:
        raise ConfigError(f"{what} must be a whole number of bytes >= 0, got {value!r}")
    return int(amount)
