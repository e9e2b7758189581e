"""Sampling parameters through the HTTP API, with speculation on: penalties, logit_bias, logprobs, n, best_of and
echo, each sent by the official openai client and read back through its typed objects."""
from __future__ import annotations

import concurrent.futures
import json

import httpx
import openai
import pytest

from server_process import live_server
from test_server import _metric, _wait_idle

MODEL = "tiny"
MAX_RUNNING, MAX_QUEUED = 7, 0  # no queue: every admitted request runs at once, whatever the others do
LIMIT = MAX_RUNNING + MAX_QUEUED
REPETITIVE = "the cat the cat the cat the cat the cat the cat"


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    # The draft is a copy of the target: it drafts every step, and penalties, bias and logprobs must hold on the
    # speculative path (verification adjusts each draft's row as plain decoding would).
    with live_server("--model", str(tiny_chat_model), "--served-model-name", MODEL, "--max-total-tokens", "8192",
                     "--page-size", "8", "--max-running-requests", str(MAX_RUNNING),
                     "--max-queued-requests", str(MAX_QUEUED), "--speculative-algorithm", "DRAFT_MODEL",
                     "--speculative-draft-model-path", str(tiny_chat_model), "--speculative-num-steps", "3",
                     "--disable-speculative-adaptive") as base:
        yield {"base": base}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["base"] + "/v1", api_key="none", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_chat_model)


def _greedy(client, **kwargs):
    extra = kwargs.pop("extra_body", {})
    return client.completions.create(model=MODEL, prompt=kwargs.pop("prompt", REPETITIVE), temperature=0,
                                     max_tokens=kwargs.pop("max_tokens", 24),
                                     extra_body={"ignore_eos": True, **extra}, **kwargs)


def _chat(text: str = "Hello there") -> list[dict]:
    return [{"role": "user", "content": text}]


# -- penalties and logit_bias ----------------------------------------------------------------------------------
def test_penalties_change_greedy_output(client, tokenizer):
    # The tiny model's weights are random and it seldom repeats itself; a +100 bias on two tokens makes greedy
    # decoding repeat the likelier one, " red", and each penalty lets " blue" in.
    red, blue = tokenizer.encode(" red")[0], tokenizer.encode(" blue")[0]
    kwargs = dict(prompt="the red red red", max_tokens=8, logit_bias={str(red): 100, str(blue): 100})
    assert _greedy(client, **kwargs).choices[0].text == " red" * 8
    for penalty in (dict(frequency_penalty=2.0), dict(presence_penalty=2.0),
                    dict(extra_body={"repetition_penalty": 2.0})):  # prompt and output: the first token changes
        text = _greedy(client, **kwargs, **penalty).choices[0].text
        assert " blue" in text, penalty
    chat = dict(model=MODEL, messages=_chat("red red red"), max_tokens=8, temperature=0,
                logit_bias={str(red): 100, str(blue): 100}, extra_body={"ignore_eos": True})
    plain = client.chat.completions.create(**chat).choices[0].message.content
    penalised = client.chat.completions.create(**chat, frequency_penalty=2.0).choices[0].message.content
    assert penalised != plain and plain.count(" red") > penalised.count(" red")
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        **chat, frequency_penalty=2.0, stream=True) if c.choices)
    assert streamed == penalised


def test_logit_bias_forces_a_token(client, tokenizer):
    token = tokenizer.encode(" cat")[0]
    text = tokenizer.decode([token])
    out = _greedy(client, prompt="Once upon a time", max_tokens=6, logit_bias={str(token): 100})
    assert out.choices[0].text == text * 6
    sampled = client.chat.completions.create(model=MODEL, messages=_chat(), max_tokens=6, temperature=1.0, seed=3,
                                             logit_bias={str(token): 100}, extra_body={"ignore_eos": True})
    assert sampled.choices[0].message.content == text * 6
    plain = _greedy(client, prompt="Once upon a time", max_tokens=2, logprobs=1)
    first = tokenizer.encode(plain.choices[0].logprobs.tokens[0])[0]
    banned = _greedy(client, prompt="Once upon a time", max_tokens=2, logprobs=1, logit_bias={str(first): -100})
    assert banned.choices[0].logprobs.tokens[0] != plain.choices[0].logprobs.tokens[0]


@pytest.mark.parametrize("bias,says", [({"49152": 1}, "vocabulary"), ({"-1": 1}, "vocabulary"),
                                       ({"cat": 1}, "token ids"), ({"5": 101}, "[-100, 100]"),
                                       ({"5": "high"}, "[-100, 100]")])
def test_bad_logit_bias_is_a_400_naming_it(client, bias, says):
    for create in (lambda: client.completions.create(model=MODEL, prompt="hi", max_tokens=2, logit_bias=bias),
                   lambda: client.chat.completions.create(model=MODEL, messages=_chat(), max_tokens=2,
                                                          logit_bias=bias)):
        with pytest.raises(openai.BadRequestError) as err:
            create()
        assert err.value.body["param"] == "logit_bias" and says in err.value.body["message"]


# -- logprobs ------------------------------------------------------------------------------------------------
def _check_chat_rows(content, top: int) -> None:
    for row in content:
        assert row.logprob <= 0 and row.bytes == list(row.token.encode("utf-8"))
        assert len(row.top_logprobs) == top
        values = [alt.logprob for alt in row.top_logprobs]
        assert values == sorted(values, reverse=True)
        # Greedy: the chosen token is the most likely one.
        assert row.top_logprobs[0].token == row.token and row.top_logprobs[0].logprob == pytest.approx(row.logprob)
        assert all(alt.bytes == list(alt.token.encode("utf-8")) for alt in row.top_logprobs)


def test_chat_logprobs_shape_streamed_and_not(client):
    kwargs = dict(model=MODEL, messages=_chat(), max_tokens=12, temperature=0, logprobs=True, top_logprobs=3,
                  extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kwargs)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens == 12
    _check_chat_rows(content, 3)
    assert "".join(row.token for row in content) == full.choices[0].message.content
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    streamed = [row for c in chunks if c.choices[0].logprobs for row in c.choices[0].logprobs.content]
    assert [(r.token, r.logprob) for r in streamed] == [(r.token, r.logprob) for r in content]
    for c in chunks:  # each chunk's logprobs are of the tokens its text came from
        if c.choices[0].delta.content:
            assert "".join(r.token for r in c.choices[0].logprobs.content) == c.choices[0].delta.content
    just_chosen = client.chat.completions.create(**{**kwargs, "top_logprobs": None})
    assert [r.top_logprobs for r in just_chosen.choices[0].logprobs.content] == [[]] * 12
    assert client.chat.completions.create(**{**kwargs, "logprobs": False, "top_logprobs": None}) \
        .choices[0].logprobs is None


def test_completion_logprobs_shape_streamed_and_not(client):
    full = _greedy(client, prompt="The sky is", max_tokens=10, logprobs=2)
    lp = full.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 10
    assert "".join(lp.tokens) == full.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(10)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and token in top and len(top) == 2  # greedy: the chosen token is among the top 2
        assert list(top.values()) == sorted(top.values(), reverse=True)
        assert top[token] == max(top.values()) == pytest.approx(logprob)
    chunks = list(_greedy(client, prompt="The sky is", max_tokens=10, logprobs=2, stream=True))
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks if c.choices[0].logprobs for o in c.choices[0].logprobs.text_offset]
    assert tokens == lp.tokens and offsets == lp.text_offset


@pytest.mark.parametrize("kwargs,param", [
    (dict(top_logprobs=2), "top_logprobs"), (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
    (dict(logprobs=True, top_logprobs=-1), "top_logprobs"), (dict(extra_body={"logprobs": 2}), "logprobs")])
def test_bad_chat_logprobs_are_a_400(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=_chat(), max_tokens=2, **kwargs)
    assert err.value.body["param"] == param


@pytest.mark.parametrize("kwargs,param", [(dict(logprobs=21), "logprobs"), (dict(logprobs=-1), "logprobs"),
                                          (dict(echo=True, logprobs=0), "echo")])
def test_bad_completion_logprobs_are_a_400(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **kwargs)
    assert err.value.body["param"] == param


# -- n and best_of ---------------------------------------------------------------------------------------------
def test_n_choices_are_indexed_distinct_and_summed(client):
    # Seeded runs are not compared across requests here: with speculation on, a seeded draw depends on where the
    # request's speculative steps begin, which depends on what else the engine admitted in the same step.
    # tests/server/test_server.py::test_n_with_a_seed_is_reproducible checks that without speculation.
    kwargs = dict(model=MODEL, messages=_chat(), max_tokens=8, temperature=1.0, seed=11, n=3,
                  extra_body={"ignore_eos": True})
    first = client.chat.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len({c.message.content for c in first.choices}) == 3  # seed, seed + 1, seed + 2
    assert first.usage.completion_tokens == 24
    streamed, finished, usage = {0: "", 1: "", 2: ""}, [], None
    for chunk in client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.append(choice.index)
        usage = chunk.usage or usage
    assert all(streamed.values()) and len(set(streamed.values())) == 3 and sorted(finished) == [0, 1, 2]
    assert usage.completion_tokens == 24
    completion = client.completions.create(model=MODEL, prompt="Once", max_tokens=5, n=2, seed=5,
                                           extra_body={"ignore_eos": True})
    assert [c.index for c in completion.choices] == [0, 1] and completion.usage.completion_tokens == 10


def test_best_of_returns_the_best_runs_best_first(client):
    kwargs = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0,
                  extra_body={"ignore_eos": True})
    best = client.completions.create(**kwargs, n=2, best_of=4, logprobs=1)
    scores = [sum(c.logprobs.token_logprobs) for c in best.choices]
    assert [c.index for c in best.choices] == [0, 1] and scores == sorted(scores, reverse=True)
    assert best.usage.completion_tokens == 32  # every run is work done
    quiet = client.completions.create(**kwargs, n=1, best_of=3)
    assert len(quiet.choices) == 1 and quiet.choices[0].logprobs is None  # computed for the ranking only


def test_best_of_ranks_by_total_logprob():
    """Which runs best_of keeps, with runs made up: the n of highest summed log-probability, best first."""
    import asyncio
    from types import SimpleNamespace

    from specserve.core import TokenLogprob
    from specserve.engine.output import RequestOutput
    from specserve.server.api import _ChunkShape, _collect
    from specserve.server.logprobs import TokenStrings

    class Run:
        def __init__(self, text: str, logprobs: list[float]) -> None:
            rows = [TokenLogprob(i, lp) for i, lp in enumerate(logprobs)]
            self.output = RequestOutput("r", [1], list(range(len(rows))), text, "length", logprobs=rows)
            self.sent = False

        def __aiter__(self):
            return self

        async def __anext__(self):
            if self.sent:
                raise StopAsyncIteration
            self.sent = True
            return self.output.text, self.output

        async def aclose(self):
            pass

    runs = [Run("a", [-1.0, -1.0]), Run("b", [-0.1, -0.2]), Run("c", [-5.0]), Run("d", [-0.5, -0.5])]
    shape = _ChunkShape("cmpl-x", MODEL, False, False, TokenStrings(SimpleNamespace(decode=lambda ids: "t")))
    response = asyncio.run(_collect(runs, shape, 2))
    body = json.loads(response.body)
    assert [c["text"] for c in body["choices"]] == ["b", "d"] and body["usage"]["completion_tokens"] == 7


def test_seeds_of_n_runs_are_seed_plus_index():
    from specserve.core import MAX_INT64, SamplingParams
    from specserve.server.api import _seeded

    assert [_seeded(SamplingParams(seed=7), i).seed for i in range(3)] == [7, 8, 9]
    assert _seeded(SamplingParams(), 2).seed is None
    assert _seeded(SamplingParams(seed=MAX_INT64), 1).seed == 0  # wraps instead of overflowing


@pytest.mark.parametrize("kwargs,param", [
    (dict(n=0), "n"), (dict(n=LIMIT + 1), "n"), (dict(best_of=LIMIT + 1, n=1), "best_of"),
    (dict(n=3, best_of=2), "best_of"), (dict(n=1, best_of=2, stream=True), "best_of")])
def test_bad_n_and_best_of_are_a_400(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, **kwargs)
    assert err.value.body["param"] == param


def _long_stream(server, **body):
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 900, "stream": True,
            "ignore_eos": True, **body}
    return httpx.stream("POST", server["base"] + "/v1/completions", json=body, timeout=30)


def _held(server) -> float:
    return _metric(server, "specserve_num_requests_running") + _metric(server, "specserve_num_requests_waiting")


def test_n_is_admitted_whole_or_not_at_all(server, client):
    streams = [_long_stream(server) for _ in range(4)]  # unread: the server holds them till they close
    try:
        with concurrent.futures.ThreadPoolExecutor(len(streams)) as pool:
            opened = list(pool.map(lambda s: s.__enter__(), streams))
        assert all(r.status_code == 200 for r in opened)
        with pytest.raises(openai.RateLimitError):  # 4 + 4 > 7
            client.completions.create(model=MODEL, prompt="more", max_tokens=2, n=4)
        # None of the 4 was admitted: 3 more still fit.
        assert len(client.completions.create(model=MODEL, prompt="more", max_tokens=2, n=3).choices) == 3
    finally:
        for stream in streams:
            stream.__exit__(None, None, None)
    _wait_idle(server)


def test_a_client_that_leaves_aborts_all_n(server):
    with _long_stream(server, n=3) as response:
        lines = response.iter_lines()
        indices = set()
        while len(indices) < 3:
            line = next(lines)
            if line.startswith("data: {"):
                indices.add(httpx.Response(200, content=line[6:]).json()["choices"][0]["index"])
        assert _held(server) == 3
    _wait_idle(server)
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 900, "ignore_eos": True, "n": 3}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server["base"] + "/v1/completions", json=body, timeout=1.0)
    _wait_idle(server)


# -- echo --------------------------------------------------------------------------------------------------------
def test_echo_puts_the_prompt_before_the_text(client, tokenizer):
    plain = _greedy(client, prompt="Once upon a time", max_tokens=6)
    echoed = _greedy(client, prompt="Once upon a time", max_tokens=6, echo=True, n=2)
    assert [c.text for c in echoed.choices] == ["Once upon a time" + plain.choices[0].text] * 2
    ids = tokenizer.encode("Once upon a time")
    assert _greedy(client, prompt=ids, max_tokens=6, echo=True).choices[0].text == echoed.choices[0].text
    chunks = list(_greedy(client, prompt="Once upon a time", max_tokens=6, echo=True, stream=True))
    assert chunks[0].choices[0].text == "Once upon a time"
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text
