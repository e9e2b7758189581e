"""The schema keywords xgrammar compiles without enforcing are refused, and only those: each refusal is held to
an instance that the compiled grammar accepts while the schema rejects it, so an xgrammar that starts
enforcing a keyword fails here (and the refusal can go)."""
from __future__ import annotations

import json

import jsonschema
import pytest
from xgrammar.testing import _is_grammar_accept_string

from specserve.bench.schemas import SCHEMAS
from specserve.structured.grammar import _json_grammar
from specserve.structured.schema_support import unsupported_keyword

OBJ = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}

REFUSED = [  # (schema, an instance xgrammar's grammar lets through but the schema rejects, the refusal's words)
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, [1, 1], "'uniqueItems'"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 3}}, [1], "'contains'"),
    ({"type": "string", "not": {"const": "x"}}, "x", "'not'"),
    ({"type": "string", "if": {"const": "x"}, "then": {"minLength": 3}}, "x", "'if'"),
    ({"type": "number", "multipleOf": 3}, 4, "'multipleOf' is supported on integers only"),
    ({"multipleOf": 3}, 4, "'multipleOf' is supported on integers only"),
    ({**OBJ, "dependentRequired": {"a": ["b"]}}, {"a": "x"}, "'dependentRequired'"),
    ({**OBJ, "dependentSchemas": {"a": {"required": ["b"]}}}, {"a": "x"}, "'dependentSchemas'"),
    ({**OBJ, "dependencies": {"a": ["b"]}, "$schema": "http://json-schema.org/draft-07/schema#"}, {"a": "x"},
     "'dependencies'"),  # draft 7's name for dependentRequired
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, 3, "'allOf' with more than one schema"),
]


@pytest.mark.parametrize("schema,instance,words", REFUSED)
def test_each_refused_keyword_is_one_xgrammar_lets_through(schema, instance, words):
    assert words in unsupported_keyword(schema)
    assert _is_grammar_accept_string(_json_grammar(json.dumps(schema)), json.dumps(instance))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(instance, schema)


def test_a_refusal_says_where_the_keyword_sits():
    schema = {"type": "object", "properties": {"tags/all": {"type": "array", "uniqueItems": True}},
              "$defs": {"n": {"anyOf": [{"type": "integer"}, {"type": "number", "multipleOf": 2}]}}}
    assert unsupported_keyword(schema) == "'uniqueItems' is not supported at /properties/tags~1all"
    del schema["properties"]
    assert unsupported_keyword(schema) == "'multipleOf' is supported on integers only at /$defs/n/anyOf/1"
    assert unsupported_keyword({"$ref": "https://example.com/s.json"}).startswith("'$ref' to another document")


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}}},  # names, not keywords
    {"type": "integer", "multipleOf": 3},
    {"type": ["integer", "null"], "multipleOf": 3},
    {"type": "array", "uniqueItems": False},
    {"allOf": [{"type": "integer", "minimum": 5}]},
    {"$defs": {"x": {"type": "integer"}}, "$ref": "#/$defs/x"},
    {"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"}}},
               {"type": "object", "properties": {"kind": {"const": "b"}}}]},
    {"type": "string", "format": "password"},  # an unknown format is an annotation
    *SCHEMAS,
])
def test_what_xgrammar_enforces_is_served(schema):
    assert unsupported_keyword(schema) is None


def test_integer_multiple_of_is_enforced():
    grammar = _json_grammar(json.dumps({"type": "integer", "multipleOf": 3}))
    assert _is_grammar_accept_string(grammar, "6") and not _is_grammar_accept_string(grammar, "7")
