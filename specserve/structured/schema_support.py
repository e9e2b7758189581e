"""The JSON-schema keywords xgrammar compiles but does not enforce, refused before any compute.

xgrammar (0.2.8) reads a schema's structure and most of its bounds, but skips a few assertions without an
error: output under such a schema could fail validation. A request naming one is refused (a 400 on the
HTTP API) rather than answered with JSON that its own schema rejects. tests/structured/test_schema_support.py
holds each refusal to an instance that xgrammar's grammar accepts and the schema rejects, so an xgrammar that
starts enforcing one shows up there.

Left alone on purpose: `oneOf`, which xgrammar reads as `anyOf` (the two differ only where branches overlap,
rare in generated schemas such as pydantic's tagged unions), and unknown `format` values, which JSON Schema
treats as annotations.
"""
from __future__ import annotations

from typing import Iterator

# Assertions that are never enforced, whatever their siblings.
_IGNORED = ("not", "if", "contains", "minContains", "maxContains", "dependentRequired", "dependentSchemas",
            "dependencies")
# Keys whose value is one subschema, a list of them, or a mapping of names to them (not those of _IGNORED:
# a node holding one is refused before its subschemas are read).
_ONE_SCHEMA = ("items", "additionalProperties", "additionalItems", "propertyNames", "unevaluatedProperties",
               "unevaluatedItems", "then", "else")
_SCHEMA_LISTS = ("prefixItems", "anyOf", "oneOf", "allOf")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


def unsupported_keyword(schema) -> str | None:
    """The first keyword xgrammar would skip, with where it sits (a JSON pointer), or None."""
    for path, node in _subschemas(schema, ""):
        problem = _problem(node)
        if problem is not None:
            return f"{problem} at {path or '/'}"
    return None


def _problem(node: dict) -> str | None:
    for key in _IGNORED:
        if key in node:
            return f"'{key}' is not supported"
    if node.get("uniqueItems") is True:
        return "'uniqueItems' is not supported"
    if "multipleOf" in node and not _integers_only(node):
        return "'multipleOf' is supported on integers only"
    if isinstance(node.get("allOf"), list) and len(node["allOf"]) > 1:
        return "'allOf' with more than one schema is not supported"
    ref = node.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"'$ref' to another document ({ref!r}) is not supported"
    return None


def _integers_only(node: dict) -> bool:
    types = node.get("type")
    types = [types] if isinstance(types, str) else types
    return isinstance(types, list) and "integer" in types and "number" not in types


def _subschemas(node, path: str) -> Iterator[tuple[str, dict]]:
    if not isinstance(node, dict):
        return
    yield path, node
    for key in _ONE_SCHEMA:
        child = node.get(key)
        if isinstance(child, list):  # "items" as a list: the draft-4 form of prefixItems
            for i, item in enumerate(child):
                yield from _subschemas(item, f"{path}/{key}/{i}")
        else:
            yield from _subschemas(child, f"{path}/{key}")
    for key in _SCHEMA_LISTS:
        children = node.get(key)
        for i, child in enumerate(children if isinstance(children, list) else ()):
            yield from _subschemas(child, f"{path}/{key}/{i}")
    for key in _SCHEMA_MAPS:
        children = node.get(key)
        for name, child in (children.items() if isinstance(children, dict) else ()):
            yield from _subschemas(child, f"{path}/{key}/{_escaped(name)}")


def _escaped(name: str) -> str:
    return str(name).replace("~", "~0").replace("/", "~1")
