"""Ten JSON schemas, each with one valid instance, for the constrained-decoding bench.

Also for tests: nested objects, arrays, enums, bounded integers, required keys, patterned
strings."""

from __future__ import annotations

from typing import Any

SCHEMAS: list[tuple[dict[str, Any], Any]] = [
    ({"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                       "age": {"type": "integer", "minimum": 0, "maximum": 120}},
      "required": ["name", "age"], "additionalProperties": False},
     {"name": "Ada", "age": 36}),
    ({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
      "required": ["color"], "additionalProperties": False},
     {"color": "green"}),
    ({"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string",
                                                                          "maxLength": 12},
                                                "minItems": 1, "maxItems": 3}},
      "required": ["tags"], "additionalProperties": False},
     {"tags": ["a", "b"]}),
    ({"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
            "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
            "required": ["id", "email"], "additionalProperties": False}},
      "required": ["user"], "additionalProperties": False},
     {"user": {"id": 7, "email": "ann@example.com"}}),
    ({"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                                       "country": {"enum": ["US", "CA", "MX"]}},
      "required": ["zip", "country"], "additionalProperties": False},
     {"zip": "94110", "country": "US"}),
    ({"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5},
      "minItems": 2, "maxItems": 4},
     [1, -2, 3]),
    ({"type": "object", "properties": {
        "items": {"type": "array", "maxItems": 2, "items": {
            "type": "object", "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}$"},
                                             "qty": {"type": "integer", "minimum": 1,
                                                     "maximum": 10}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
      "required": ["items"], "additionalProperties": False},
     {"items": [{"sku": "ABC", "qty": 2}]}),
    ({"type": "object", "properties": {"ok": {"type": "boolean"},
                                       "score": {"type": "number", "minimum": 0, "maximum": 1}},
      "required": ["ok", "score"], "additionalProperties": False},
     {"ok": True, "score": 0.5}),
    ({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 16},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}},
      "required": ["city", "unit"], "additionalProperties": False},
     {"city": "Paris", "unit": "celsius"}),
    ({"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 24},
        "meta": {"type": "object", "properties": {
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "genre": {"enum": ["drama", "comedy", "documentary"]}},
            "required": ["year"], "additionalProperties": False}},
      "required": ["title", "meta"], "additionalProperties": False},
     {"title": "Up", "meta": {"year": 2009, "genre": "comedy"}}),
]
