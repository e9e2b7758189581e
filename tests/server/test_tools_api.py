"""Tool calling through the HTTP API with speculation on, sent by the official openai client: tool_choice
required / named / auto / none, the tool_calls message and its streamed deltas, a conversation that carries a
tool result, and a 400 for tools that cannot be served. The tiny model shares SmolLM2's template, which ignores
`tools`: it gets the hermes format (server/tools.py), and the grammar makes every call parse."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from server_process import self_drafting_client

MODEL = "tiny"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
CLOCK = {"type": "object", "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 12}},
         "required": ["zone"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": CLOCK}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": CLOCK}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(tiny_chat_model):
    with self_drafting_client(tiny_chat_model, MODEL) as client:
        yield client


def _ask(client, **kwargs):
    kwargs.setdefault("max_tokens", 120)
    kwargs.setdefault("temperature", 0)
    return client.chat.completions.create(model=MODEL, messages=kwargs.pop("messages", ASK), tools=TOOLS,
                                          **kwargs)


def _valid_calls(message, names=SCHEMAS) -> list:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    return message.tool_calls


def test_required_and_named_always_call(client):
    for seed in range(2):
        # One call at most: then the grammar ends the reply (the tiny model would write text after it).
        choice = _ask(client, tool_choice="required", temperature=1.0, seed=seed, parallel_tool_calls=False).choices[0]
        _valid_calls(choice.message)
        assert choice.finish_reason == "tool_calls"
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(1):
        choice = _ask(client, tool_choice=named, temperature=1.0, seed=seed).choices[0]
        calls = _valid_calls(choice.message, names={"get_time"})
        assert len(calls) == 1 and choice.finish_reason == "tool_calls"


def test_auto_gives_text_or_a_valid_call(client):
    for seed in range(2):
        choice = _ask(client, tool_choice="auto", temperature=1.0, seed=seed, max_tokens=24).choices[0]
        if choice.message.tool_calls:
            _valid_calls(choice.message)
        else:
            assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")
    # "none": plain text, never read for calls.
    plain = _ask(client, tool_choice="none", max_tokens=8).choices[0]
    assert plain.message.tool_calls is None and isinstance(plain.message.content, str)


def test_streamed_deltas_reassemble_the_reply(client):
    for kwargs in (dict(tool_choice="required", parallel_tool_calls=False),
                   dict(tool_choice={"type": "function", "function": {"name": "get_weather"}}, temperature=1.0,
                        seed=5)):
        whole = _ask(client, **kwargs).choices[0]
        content, calls, finish = "", {}, None
        for chunk in _ask(client, stream=True, **kwargs):
            for choice in chunk.choices:
                content += choice.delta.content or ""
                finish = choice.finish_reason or finish
                for delta in choice.delta.tool_calls or []:
                    entry = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                    if delta.id:
                        assert entry["id"] is None and delta.function.name  # the id and name come once, first
                        entry["id"], entry["name"] = delta.id, delta.function.name
                    entry["arguments"] += delta.function.arguments or ""
        assert content == (whole.message.content or "") and finish == whole.finish_reason == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in calls.values()] == \
            [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
        assert all(c["id"] for c in calls.values())


def test_a_tool_result_round_trips(client):
    first = _ask(client, tool_choice="required", parallel_tool_calls=False).choices[0].message
    call = first.tool_calls[0]
    history = [*ASK, {"role": "assistant", "content": first.content,
                      "tool_calls": [{"id": call.id, "type": "function",
                                      "function": {"name": call.function.name,
                                                   "arguments": call.function.arguments}}]},
               {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    again = _ask(client, messages=history, tool_choice="required", parallel_tool_calls=False)
    _valid_calls(again.choices[0].message)
    # The call and its result are in the prompt: longer than the question alone by at least both.
    alone = _ask(client, tool_choice="none", max_tokens=1).usage.prompt_tokens
    assert again.usage.prompt_tokens > alone + len(call.function.arguments) // 4


BAD = [
    ("tools", dict(tools=[{"type": "retrieval"}])),
    ("tools", dict(tools=[{"type": "function", "function": {"name": "bad name!"}}])),
    ("tools", dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}])),
    ("tools", dict(tools=[TOOLS[0], TOOLS[0]])),
    ("tool_choice", dict(tool_choice={"type": "function", "function": {"name": "nope"}})),
    ("tool_choice", dict(tool_choice="sometimes")),
    ("tool_choice", dict(tool_choice="required", response_format={"type": "json_object"})),
    ("messages", dict(messages=[*ASK, {"role": "tool", "tool_call_id": "c", "content": "18"}])),  # no call before
    ("messages", dict(messages=[*ASK, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_time", "arguments": "{not json"}}]}])),
]


@pytest.mark.parametrize("param,kwargs", BAD, ids=[f"{p}-{i}" for i, (p, _) in enumerate(BAD)])
def test_bad_tools_are_400(client, param, kwargs):
    kwargs = {"tools": TOOLS, "messages": ASK, **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, max_tokens=4, **kwargs)
    assert err.value.body["param"] == param, err.value.body
    with pytest.raises(openai.BadRequestError) as err:  # the deprecated form stays refused by name
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4,
                                       extra_body={"functions": [{"name": "f", "parameters": {}}]})
    assert err.value.body["param"] == "functions"
