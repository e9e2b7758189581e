"""Structured output in the HTTP API: OpenAI's `response_format` (json_object, json_schema) and SGLang's
`regex`, `ebnf` and `json_schema` (a string) request fields, read into one core.Constraint; and the front-end's
check that it compiles, so an invalid grammar is a 400 before the request reaches the engine."""
from __future__ import annotations

import json

from specserve.core import Constraint
from specserve.structured.grammar import Grammars

# The front-end's compiled grammars: it only checks them (the engine compiles its own), so a small bound.
FRONT_END_CACHE_SIZE = 64


class ConstraintError(ValueError):
    """A request's constraint that cannot be served; `param` names the field at fault."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def constraint_of(body) -> Constraint | None:
    """The one constraint a request asks for (None: free text); ConstraintError if it asks for several or for
    one in a form this server does not read."""
    found = [(name, c) for name, c in (("response_format", _response_format(getattr(body, "response_format", None))),
                                       ("regex", _text("regex", body.regex)), ("ebnf", _text("ebnf", body.ebnf)),
                                       ("json_schema", _schema_text(body.json_schema, "json_schema")))
             if c is not None]
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise ConstraintError(f"a request takes one output constraint, got {names}", param=found[1][0])
    return found[0][1] if found else None


def checked_constraint(body, grammars: Grammars) -> Constraint | None:
    """`constraint_of(body)`, compiled once to refuse an invalid grammar up front."""
    constraint = constraint_of(body)
    if constraint is not None:
        try:
            grammars.compile(constraint)
        except ValueError as e:
            raise ConstraintError(str(e), param=_param_of(body, constraint)) from None
    return constraint


def front_end_grammars(tokenizer, vocab_size: int) -> Grammars:
    return Grammars(lambda: tokenizer, vocab_size, (), cache_size=FRONT_END_CACHE_SIZE)


def _response_format(value: dict | None) -> Constraint | None:
    if value is None:
        return None
    kind = value.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise ConstraintError('response_format of type "json_schema" needs a "json_schema" object '
                                  '({"name": ..., "schema": {...}})', param="response_format")
        if spec.get("schema") is None:  # OpenAI's schema is optional: any JSON object then
            return Constraint("json_object")
        return _schema_text(spec["schema"], "response_format")
    raise ConstraintError(f'response_format type must be "text", "json_object" or "json_schema", got {kind!r}',
                          param="response_format")


def _schema_text(schema, param: str) -> Constraint | None:
    """A schema given as a JSON object or as its text (SGLang's `json_schema` field)."""
    if schema is None:
        return None
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ConstraintError(f"{param}: the schema is not valid JSON ({e})", param=param) from None
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(f"{param}: a JSON schema is an object, got {type(schema).__name__}", param=param)
    return Constraint("json_schema", json.dumps(schema))


def _text(name: str, value: str | None) -> Constraint | None:
    if value is None:
        return None
    if not value:
        raise ConstraintError(f"{name} is empty", param=name)
    return Constraint(name, value)


def _param_of(body, constraint: Constraint) -> str:
    if constraint.kind in ("regex", "ebnf"):
        return constraint.kind
    return "json_schema" if getattr(body, "json_schema", None) is not None else "response_format"
