"""JSON schemas for structured output: the benchmark's `json-schema` workload and the tests' suite. They cover
nested objects, arrays, enums and consts, numbers with bounds, anyOf, strings with patterns,
additionalProperties false and required. Each bounds every string, array and number it allows, so even a
random model's output reaches the grammar's end within a few dozen tokens and can be checked whole."""
from __future__ import annotations

import json

NAME = {"type": "string", "maxLength": 8}
SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}

SCHEMAS: list[dict] = [
    # flat objects, required fields, additionalProperties false
    {"type": "object", "properties": {"name": NAME, "age": SMALL_INT}, "required": ["name", "age"],
     "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": -5, "maximum": 5}, "note": {"type": "null"}},
     "required": ["id", "note"], "additionalProperties": False},
    # enums and consts
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"],
     "additionalProperties": False},
    {"type": "object", "properties": {"kind": {"const": "point"}, "x": SMALL_INT, "y": SMALL_INT},
     "required": ["kind", "x", "y"], "additionalProperties": False},
    {"enum": ["yes", "no", "maybe"]},
    {"enum": [1, 2, 3, "many"]},
    # numbers with bounds
    {"type": "object", "properties": {"score": {"type": "integer", "minimum": 10, "maximum": 20}},
     "required": ["score"], "additionalProperties": False},
    {"type": "object", "properties": {"year": {"type": "integer", "minimum": 1900, "maximum": 2100},
                                      "month": {"type": "integer", "minimum": 1, "maximum": 12}},
     "required": ["year", "month"], "additionalProperties": False},
    {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 50},
    # arrays
    {"type": "array", "items": SMALL_INT, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    {"type": "object", "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 2}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "array", "prefixItems": [{"type": "boolean"}, SMALL_INT], "items": False, "minItems": 2},
    # nested objects
    {"type": "object", "properties": {"user": {"type": "object", "properties": {"name": NAME, "admin": {"type": "boolean"}},
                                               "required": ["name", "admin"], "additionalProperties": False}},
     "required": ["user"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": SMALL_INT}, "required": ["c"], "additionalProperties": False}}, "required": ["b"],
        "additionalProperties": False}}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"points": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"x": SMALL_INT, "y": SMALL_INT}, "required": ["x", "y"],
        "additionalProperties": False}}}, "required": ["points"], "additionalProperties": False},
    # anyOf
    {"anyOf": [SMALL_INT, {"type": "boolean"}]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "string", "maxLength": 4}, {"type": "null"}]}},
     "required": ["value"], "additionalProperties": False},
    {"type": "object", "properties": {"shape": {"anyOf": [
        {"type": "object", "properties": {"r": SMALL_INT}, "required": ["r"], "additionalProperties": False},
        {"type": "object", "properties": {"w": SMALL_INT, "h": SMALL_INT}, "required": ["w", "h"],
         "additionalProperties": False}]}}, "required": ["shape"], "additionalProperties": False},
    # strings with patterns and lengths
    {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["zip"],
     "additionalProperties": False},
    {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{1,3}$"},
                                      "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
     "required": ["code", "date"], "additionalProperties": False},
    {"type": "string", "minLength": 2, "maxLength": 6},
    # optional properties next to required ones
    {"type": "object", "properties": {"title": NAME, "pages": SMALL_INT, "draft": {"type": "boolean"}},
     "required": ["title"], "additionalProperties": False},
]


def schema_request(schema: dict) -> list[dict]:
    """The chat messages asking for a JSON value that follows `schema`."""
    return [{"role": "user", "content": "Reply with JSON that follows this JSON schema, and nothing else:\n"
             + json.dumps(schema)}]
