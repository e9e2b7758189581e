"""Structured output through the HTTP API and the official openai client: response_format on chat and
completions, SGLang's regex, ebnf and json_schema fields (extra_body), and a 400 that names what is wrong for
an invalid or unsupported constraint, before any compute."""
from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest

from server_process import self_drafting_client

MODEL = "tiny"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "size": {"enum": ["S", "M", "L"]},
                                           "count": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["name", "size", "count"], "additionalProperties": False}


@pytest.fixture(scope="module")
def client(tiny_chat_model):
    with self_drafting_client(tiny_chat_model, MODEL) as client:
        yield client


def _schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "order", "schema": schema, "strict": True}}


def test_chat_response_format_json_schema(client):
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "An order, please"}],
                                           max_tokens=80, temperature=0, response_format=_schema_format(SCHEMA))
    choice = reply.choices[0]
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert choice.finish_reason == "stop"


def test_completions_json_object_and_sglang_fields(client):
    reply = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=80, temperature=0.8, seed=3,
                                      extra_body={"json_schema": json.dumps(SCHEMA)})
    jsonschema.validate(json.loads(reply.choices[0].text), SCHEMA)
    reply = client.completions.create(model=MODEL, prompt="Answer:", max_tokens=40, temperature=0,
                                      extra_body={"regex": r"(yes|no)!{1,3}"})
    assert re.fullmatch(r"(yes|no)!{1,3}", reply.choices[0].text)
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick"}],
                                           max_tokens=40, temperature=0,
                                           extra_body={"ebnf": 'root ::= "pick " [a-c] ("," [a-c]){0,2}'})
    assert re.fullmatch(r"pick [a-c](,[a-c]){0,2}", reply.choices[0].message.content)
    reply = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=40, temperature=0,
                                      extra_body={"response_format": {"type": "json_object"}})
    assert reply.choices[0].finish_reason == "length" or isinstance(json.loads(reply.choices[0].text), dict)


@pytest.mark.parametrize("extra, param, words", [
    ({"response_format": _schema_format({"type": "object", "properties": {"a": {"type": "nonsense"}}})},
     "response_format", "invalid json schema"),
    ({"response_format": _schema_format({"type": "object", "properties": {"t": {"uniqueItems": True}}})},
     "response_format", "unsupported json schema: 'uniqueItems' is not supported at /properties/t"),
    ({"json_schema": json.dumps({"type": "number", "multipleOf": 0.5})}, "json_schema",
     "'multipleOf' is supported on integers only"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "needs a \"json_schema\" object"),
    ({"response_format": {"type": "yaml"}}, "response_format", "response_format type must be"),
    ({"json_schema": "{not json"}, "json_schema", "not valid JSON"),
    ({"regex": "a(b"}, "regex", "invalid regex"),
    ({"ebnf": "root ::= undefined_rule"}, "ebnf", "invalid ebnf"),
    ({"regex": "a+", "ebnf": 'root ::= "a"'}, "ebnf", "one output constraint"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]}, "tools",
     "Unsupported type"),  # tool calls are grammars too (tests/server/test_tools_api.py)
])
def test_invalid_constraints_are_a_400_naming_the_problem(client, extra, param, words):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                       extra_body=extra)
    assert err.value.status_code == 400
    assert words in err.value.body["message"] and err.value.body["param"] == param
