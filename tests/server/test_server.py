"""The HTTP server, end to end: a real uvicorn process, the official openai client, bad input, disconnects."""
from __future__ import annotations

import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from server_process import free_port

API_KEY = "test-key"
MODEL = "tiny"
CONTEXT = 1024
MAX_RUNNING, MAX_QUEUED = 4, 2


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    port = free_port()
    cmd = [
        sys.executable, "-m", "specserve.cli", "serve", "--model", str(tiny_chat_model), "--port", str(port),
        "--api-key", API_KEY, "--served-model-name", MODEL, "--max-running-requests", str(MAX_RUNNING),
        "--max-queued-requests", str(MAX_QUEUED), "--max-total-tokens", "8192", "--page-size", "8",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    statuses = []
    deadline = time.time() + 180
    while time.time() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode()
        try:
            statuses.append(httpx.get(f"{base}/health", timeout=2).status_code)
        except httpx.TransportError:
            time.sleep(0.05)
            continue
        if statuses[-1] == 200:
            break
        time.sleep(0.05)
    assert statuses and statuses[-1] == 200, f"server never became healthy: {statuses[-5:]}"
    yield {"base": base, "statuses": statuses, "proc": proc}
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)
    # The engine process goes down with the server: nothing is left running in its process group.
    deadline, leftover = time.time() + 10, ["?"]
    while leftover and time.time() < deadline:
        time.sleep(0.2)
        leftover = subprocess.run(["pgrep", "-a", "-g", str(proc.pid)], capture_output=True, text=True).stdout.splitlines()
    assert not leftover, f"processes left behind: {leftover}"


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key=API_KEY, max_retries=0)


def _metric(server, name: str) -> float:
    text = httpx.get(server["base"] + "/metrics").text
    match = re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def _wait_idle(server, timeout: float = 20.0) -> None:
    """Running, waiting and KV pages all return to zero: nothing leaked."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if (_metric(server, "specserve_kv_pages_used"), _metric(server, "specserve_num_requests_running"),
                _metric(server, "specserve_num_requests_waiting")) == (0, 0, 0):
            return
        time.sleep(0.1)
    raise AssertionError("requests or KV pages still held after the clients went away")


def _chat(text: str = "Hello there") -> list[dict]:
    return [{"role": "user", "content": text}]


# -- health, models, metrics ---------------------------------------------------
def test_health_says_503_while_loading_then_200(server):
    assert 503 in server["statuses"], "the port should open before the model is loaded"
    assert httpx.get(server["base"] + "/health").status_code == 200


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_metrics_expose_the_promised_series(server, client):
    before = _metric(server, "specserve_generation_tokens_total")
    client.completions.create(model=MODEL, prompt="count:", max_tokens=5, temperature=0,
                              extra_body={"ignore_eos": True})
    text = httpx.get(server["base"] + "/metrics").text
    for name in ("specserve_num_requests_running", "specserve_num_requests_waiting", "specserve_kv_pages_used",
                 "specserve_kv_cache_bytes_per_token",
                 "specserve_prompt_tokens_total", "specserve_generation_tokens_total",
                 "specserve_time_to_first_token_seconds_bucket", "specserve_inter_token_latency_seconds_bucket"):
        assert name in text
    assert _metric(server, "specserve_generation_tokens_total") == before + 5
    assert _metric(server, "specserve_spec_drafting") == 0  # no speculation configured


# -- the OpenAI API ------------------------------------------------------------
def test_chat_completion_non_streaming_and_streaming_agree(client):
    full = client.chat.completions.create(model=MODEL, messages=_chat(), max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert full.object == "chat.completion" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + 12
    stream = client.chat.completions.create(model=MODEL, messages=_chat(), max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == 12 and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_non_streaming_and_streaming_agree(client):
    full = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.usage.completion_tokens == 10 and full.choices[0].finish_reason == "length"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(model=MODEL, prompt="The sky is", max_tokens=10, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
    )
    assert streamed == full.choices[0].text


def test_stop_string_and_seed_through_the_api(client):
    full = client.completions.create(model=MODEL, prompt="Once", max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[8:11]
    cut = client.completions.create(model=MODEL, prompt="Once", max_tokens=20, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True}).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]
    a, b = (client.completions.create(model=MODEL, prompt="Once", max_tokens=10, temperature=1.0, seed=7)
            .choices[0].text for _ in range(2))
    assert a == b


def test_n_with_a_seed_is_reproducible(client):
    """Run i of n draws with seed + i: the same choices every time, streamed or not. (top_k=2: the random tiny
    model's distribution is nearly flat, and a draw among 49k nearly equal tokens can turn on the last bit of a
    logit, which differs with the batch; among two it cannot.)"""
    kwargs = dict(model=MODEL, messages=_chat(), max_tokens=8, temperature=1.0, seed=11, n=3,
                  extra_body={"ignore_eos": True, "top_k": 2})
    texts = [c.message.content for c in client.chat.completions.create(**kwargs).choices]
    assert len(set(texts)) == 3
    streamed = {0: "", 1: "", 2: ""}
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert [streamed[i] for i in range(3)] == texts
    alone = client.chat.completions.create(**{**kwargs, "n": 1, "seed": 12}).choices[0].message.content
    assert alone == texts[1]


# -- bad input: a clear 4xx, and nothing else changes ----------------------------------
BAD_REQUESTS = [
    ("temperature is negative", dict(temperature=-0.5), 400),
    ("top_p is zero", dict(top_p=0.0), 400),
    ("top_p above one", dict(top_p=1.5), 400),
    ("max_tokens is zero", dict(max_tokens=0), 400),
    ("max_tokens is negative", dict(max_tokens=-3), 400),
    ("max_tokens beyond the context", dict(max_tokens=CONTEXT + 1), 400),
    ("temperature has the wrong type", dict(temperature="hot"), 400),
    ("max_tokens has the wrong type", dict(max_tokens=[1]), 400),
    ("messages has the wrong type", dict(messages="hi"), 400),
    ("unknown model", dict(model="no-such-model"), 404),
]


@pytest.mark.parametrize("why,override,status", BAD_REQUESTS, ids=[b[0] for b in BAD_REQUESTS])
def test_bad_chat_requests_get_openai_style_errors(server, why, override, status):
    body = {"model": MODEL, "messages": _chat(), "max_tokens": 4, **override}
    r = httpx.post(server["base"] + "/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] and error["code"] == status
    _wait_idle(server, timeout=2)


def test_bad_input_raises_the_right_openai_exceptions(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=_chat(), temperature=-1)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="hi")


def test_unsupported_options_are_refused_not_ignored(client):
    for extra in (dict(suffix="tail"), dict(echo=True, logprobs=2), dict(n=2, best_of=1)):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **extra)


def test_malformed_json_is_a_400(server):
    r = httpx.post(server["base"] + "/v1/completions", content=b'{"model": "tiny", "prompt": ',
                   headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_prompt_longer_than_the_context_is_a_400(client, server):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt=list(range(100, 100 + CONTEXT + 5)), max_tokens=1)
    assert "context" in str(err.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=_chat("word " * (CONTEXT + 10)), max_tokens=1)
    _wait_idle(server, timeout=2)


def test_api_key_is_required(server):
    r = httpx.post(server["base"] + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 401 and r.json()["error"]["code"] == 401
    assert httpx.get(server["base"] + "/health").status_code == 200  # health stays open for probes


# -- disconnects and back-pressure ----------------------------------------------------
def _long_stream_request(server):
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 900, "stream": True,
            "ignore_eos": True}
    return httpx.stream("POST", server["base"] + "/v1/completions", json=body, timeout=30,
                        headers={"Authorization": f"Bearer {API_KEY}"})


def test_client_disconnect_mid_stream_aborts_and_frees_pages(server):
    with _long_stream_request(server) as response:
        lines = response.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert _metric(server, "specserve_kv_pages_used") > 0
    _wait_idle(server)


def test_non_streaming_client_that_gives_up_frees_pages(server):
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server["base"] + "/v1/completions", json=body, timeout=1.0,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    _wait_idle(server)


def test_full_queue_answers_429_and_recovers(server, client):
    streams = [_long_stream_request(server) for _ in range(MAX_RUNNING + MAX_QUEUED)]
    opened = []
    try:
        with concurrent.futures.ThreadPoolExecutor(len(streams)) as pool:
            opened = list(pool.map(lambda s: s.__enter__(), streams))
        for response in opened:
            assert response.status_code == 200
        with pytest.raises(openai.RateLimitError):
            client.completions.create(model=MODEL, prompt="one more", max_tokens=2)
    finally:
        for stream in streams:
            stream.__exit__(None, None, None)
    _wait_idle(server)
    assert client.completions.create(model=MODEL, prompt="again", max_tokens=2).usage.completion_tokens >= 1


def test_a_request_larger_than_the_whole_kv_pool_is_a_400_before_streaming():
    from types import SimpleNamespace

    from specserve.config import CacheConfig, EngineConfig
    from specserve.engine.engine import EngineStats
    from specserve.core import SamplingParams
    from specserve.server.api import APIError, _check_fits_in_pool

    engine = SimpleNamespace(stats=EngineStats(0, 0, 0, 4, 0), config=EngineConfig(cache=CacheConfig(page_size=8)),
                             context_length=1024)
    _check_fits_in_pool(engine, 10, SamplingParams(max_tokens=22))  # 32 tokens: exactly the pool
    with pytest.raises(APIError) as err:
        _check_fits_in_pool(engine, 10, SamplingParams(max_tokens=23))
    assert err.value.status == 400
