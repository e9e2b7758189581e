"""Hostile and unsupported input against a live server: every case is a 4xx with an OpenAI-style error body,
never a 500, and the server keeps serving. The official client sends what it can; httpx sends raw bodies."""
from __future__ import annotations

import json
import math

import httpx
import openai
import pytest

from server_process import live_server

MODEL = "tiny"
VOCAB = 49152  # tiny_chat_model shares SmolLM2's vocabulary


@pytest.fixture(scope="module")
def base(tiny_chat_model):
    with live_server("--model", str(tiny_chat_model), "--served-model-name", MODEL, "--max-total-tokens", "8192",
                     "--page-size", "8") as url:
        yield url


@pytest.fixture(scope="module")
def client(base):
    return openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)


def _chat(text: str = "Hello") -> list[dict]:
    return [{"role": "user", "content": text}]


def _error(response: httpx.Response, status: int) -> dict:
    """The body is OpenAI's error form, with the status as its code."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["message"] and error["type"] and error["code"] == status
    return error


def _post(base: str, path: str, body: bytes | str, content_type: str = "application/json") -> httpx.Response:
    return httpx.post(base + path, content=body, headers={"Content-Type": content_type}, timeout=30)


def _still_serves(client) -> None:
    out = client.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=2, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 2


# -- 5: token ids outside the vocabulary -------------------------------------------------
@pytest.mark.parametrize("prompt", [[1, 2, 1_000_000], [1, -5, 3], [1, 2**63], [1, VOCAB], [-1]],
                         ids=["huge", "negative", "2**63", "vocab_size", "minus_one"])
def test_token_ids_outside_the_vocabulary_are_a_400(client, prompt):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=2)
    assert err.value.body["param"] == "prompt" and "vocabulary" in err.value.body["message"]
    _still_serves(client)


def test_the_last_id_of_the_vocabulary_is_accepted(client):
    out = client.completions.create(model=MODEL, prompt=[1, VOCAB - 1], max_tokens=1)
    assert out.usage.prompt_tokens == 2


# -- 6: text that is not valid Unicode ------------------------------------------------------
@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "\\ud800 hi"}]}'),
    ("/v1/chat/completions",
     '{"model": "tiny", "messages": [{"role": "user", "content": [{"type": "text", "text": "a\\udfff"}]}]}'),
    ("/v1/completions", '{"model": "tiny", "prompt": "\\ud800 hi", "max_tokens": 2}'),
    ("/v1/completions", '{"model": "tiny", "prompt": "hi", "max_tokens": 2, "stop": ["\\udc00"]}'),
], ids=["chat_content", "chat_content_part", "prompt", "stop"])
def test_a_lone_surrogate_is_a_400(base, client, path, body):
    error = _error(_post(base, path, body), 400)
    assert "surrogate" in error["message"]
    _still_serves(client)


# -- 7: max_completion_tokens ----------------------------------------------------------------
@pytest.mark.parametrize("value", [0, -1])
def test_max_completion_tokens_below_one_is_a_400(client, value):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=_chat(), max_completion_tokens=value)
    assert err.value.body["param"] == "max_completion_tokens"


def test_max_completion_tokens_wins_and_none_falls_back_to_max_tokens(client):
    ignore = {"ignore_eos": True}
    both = client.chat.completions.create(model=MODEL, messages=_chat(), max_completion_tokens=2, max_tokens=5,
                                          extra_body=ignore)
    assert both.usage.completion_tokens == 2
    fallback = client.chat.completions.create(model=MODEL, messages=_chat(), max_tokens=3,
                                              extra_body={**ignore, "max_completion_tokens": None})
    assert fallback.usage.completion_tokens == 3


# -- 8: sampling values that are not numbers, or absurd ---------------------------------------
NAN, INF = math.nan, math.inf
BAD_VALUES = [
    ("temperature", NAN), ("temperature", INF), ("temperature", -INF), ("temperature", 1e9),
    ("top_p", NAN), ("top_p", INF), ("min_p", NAN), ("min_p", -INF), ("top_k", 2**63),
    ("presence_penalty", NAN), ("frequency_penalty", INF), ("repetition_penalty", NAN),
    ("repetition_penalty", -1.0),
]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
@pytest.mark.parametrize("name,value", BAD_VALUES, ids=[f"{n}={v}" for n, v in BAD_VALUES])
def test_non_finite_or_absurd_sampling_values_are_a_400(base, client, path, name, value):
    body = {"model": MODEL, "max_tokens": 2, "top_p": 0.9, name: value}  # top_p < 1 sends top_k to the sort
    body.update({"messages": _chat()} if path == "/v1/chat/completions" else {"prompt": "hi"})
    error = _error(_post(base, path, json.dumps(body)), 400)  # json.dumps writes NaN and Infinity as JS does
    assert name in error["message"]
    _still_serves(client)


def test_temperature_bound_is_named_in_the_error(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=_chat(), temperature=1e9, max_tokens=2)
    assert "[0, 100]" in err.value.body["message"]


def test_sampling_params_refuse_non_finite_values():
    from specserve.core import SamplingParams

    for field in ("temperature", "top_p", "min_p"):
        for value in (NAN, INF, -INF):
            with pytest.raises(ValueError, match=field):
                SamplingParams(**{field: value})
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=101.0)
    SamplingParams(temperature=100.0, top_p=1.0, min_p=0.0)  # the bounds themselves are fine


# -- 9: every error in OpenAI form --------------------------------------------------------------
def test_invalid_utf8_body_is_a_400(base):
    _error(_post(base, "/v1/completions", b'{"model": "tiny", "prompt": "\xff\xfe bad"}'), 400)


@pytest.mark.parametrize("body", ["[" * 100_000 + "]" * 100_000,
                                  '{"model": "tiny", "prompt": "hi", "stream_options": ' + '{"a": ' * 5000 + "1"
                                  + "}" * 5001,
                                  '{"model": "tiny", "prompt": "hi", "logit_bias": ' + "[" * 900 + "]" * 900 + "}"],
                         ids=["top_level", "inside_a_field", "just_under_the_parser_limit"])
def test_deeply_nested_json_is_a_400(base, client, body):
    _error(_post(base, "/v1/completions", body), 400)
    _still_serves(client)


@pytest.mark.parametrize("body,content_type", [
    ('{"model": "tiny", "prompt": ', "application/json"),
    ("", "application/json"),
    ("not json at all", "application/json"),
    ('"a string"', "application/json"),
    ('{"model": "tiny", "prompt": "hi"}', "text/plain"),
    ('{"prompt": "hi"}', "application/json"),
    ('{"model": "tiny", "prompt": "hi", "max_tokens": "many"}', "application/json"),
], ids=["truncated", "empty", "not_json", "not_an_object", "wrong_content_type", "missing_model", "wrong_type"])
def test_malformed_bodies_are_a_400(base, body, content_type):
    _error(_post(base, "/v1/completions", body, content_type), 400)


def test_unknown_path_is_a_404_and_wrong_method_a_405(base):
    _error(httpx.get(base + "/v1/no-such-thing"), 404)
    _error(httpx.post(base + "/nowhere", json={}), 404)
    response = httpx.get(base + "/v1/chat/completions")
    _error(response, 405)
    assert "POST" in response.headers["allow"]


def test_openapi_documents_400_not_422(base):
    schema = httpx.get(base + "/openapi.json").json()
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = schema["paths"][path]["post"]["responses"]
        assert "422" not in responses and "400" in responses, responses
        ref = responses["400"]["content"]["application/json"]["schema"]["$ref"]
        error = schema["components"]["schemas"][ref.rsplit("/", 1)[-1]]
        assert "error" in error["properties"]
    assert "422" not in json.dumps(schema["paths"])


# -- 13: parameters we do not implement are refused, not ignored (tests/server/test_sampling_api.py has those that
# are implemented now: penalties, logit_bias, logprobs, n, best_of, echo; test_tools_api.py, tools) ------------
CHAT_REFUSED = [
    ("n", dict(n=0)), ("top_logprobs", dict(top_logprobs=2)),
    ("tool_choice", dict(tool_choice="required")),  # without tools (tests/server/test_tools_api.py has the rest)
    ("functions", dict(extra_body={"functions": [{"name": "f", "parameters": {}}]})),
]
COMPLETION_REFUSED = [
    ("n", dict(n=0)), ("best_of", dict(n=2, best_of=1)), ("echo", dict(echo=True, logprobs=0)),
    ("suffix", dict(suffix="tail")),
]


@pytest.mark.parametrize("param,kwargs", CHAT_REFUSED, ids=[f"{p}-{i}" for i, (p, _) in enumerate(CHAT_REFUSED)])
def test_unsupported_chat_parameters_are_refused_by_name(client, param, kwargs):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=_chat(), max_tokens=2, **kwargs)
    assert err.value.body["param"] == param and param in err.value.body["message"]


@pytest.mark.parametrize("param,kwargs", COMPLETION_REFUSED,
                         ids=[f"{p}-{i}" for i, (p, _) in enumerate(COMPLETION_REFUSED)])
def test_unsupported_completion_parameters_are_refused_by_name(client, param, kwargs):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **kwargs)
    assert err.value.body["param"] == param and param in err.value.body["message"]


def test_defaults_of_unsupported_parameters_stay_accepted(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=_chat(), max_tokens=2, n=1, logprobs=False, presence_penalty=0, frequency_penalty=0,
        logit_bias={}, response_format={"type": "text"}, tool_choice="none",
        extra_body={"repetition_penalty": 1.0, "tools": [], "best_of": 1, "top_logprobs": None},
    )
    assert chat.choices[0].message.role == "assistant"
    completion = client.completions.create(
        model=MODEL, prompt="hi", max_tokens=2, n=1, best_of=1, echo=False, suffix="", presence_penalty=0.0,
        frequency_penalty=0.0, logit_bias={}, extra_body={"repetition_penalty": 1, "logprobs": None},
    )
    assert completion.usage.completion_tokens >= 1
