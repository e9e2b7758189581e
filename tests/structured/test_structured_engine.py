"""Structured output through the engine (the offline LLM API), without speculation and with an EAGLE-3 chain
and tree: every output matches its grammar, greedy output is the same with and without speculation, and
unconstrained requests sharing the batches are unaffected. The tiny random chat model decodes real text; its
random head drafts over part of the vocabulary, so masks go through the draft-to-target map."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest

from specserve.bench.schemas import SCHEMAS
from specserve.config import SpecConfig
from specserve.core import Constraint, SamplingParams
from engine_runs import run_batch

REGEX = r"(yes|no), [a-z]{2,5} [0-9]{1,3}\."
EBNF = 'root ::= "(" item ("," item){0,3} ")"\nitem ::= [a-c] | [0-9] [0-9]?'
FREE_PROMPTS = ["Tell me a story.", "1, 2, 3,"]
CONFIGS = {"off": None, "chain": (3, 1, None), "tree": (3, 2, 6)}


# Every configuration samples the whole suite, as it decodes it greedily.
SAMPLED = {name: list(range(len(SCHEMAS))) for name in ("off", "chain", "tree")}


def schema_params(temperature: float, indices: list[int]) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=120, temperature=temperature, seed=i,
                           constraint=Constraint("json_schema", json.dumps(SCHEMAS[i]))) for i in indices]


def prompt(i: int) -> str:
    return f"Answer in JSON following the schema {json.dumps(SCHEMAS[i])}"


FREE = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
GRAMMAR_PARAMS = [SamplingParams(max_tokens=60, temperature=0.0, constraint=Constraint("regex", REGEX)),
                  # ignore_eos: the grammar's end finishes the request all the same
                  SamplingParams(max_tokens=60, temperature=1.0, seed=5, ignore_eos=True,
                                 constraint=Constraint("ebnf", EBNF)),
                  SamplingParams(max_tokens=60, temperature=0.0, constraint=Constraint("json_object"))]


def run(llm, prompts, params):
    return run_batch(llm, prompts, params)[0]


@pytest.fixture(scope="module")
def runs(tiny_chat_model, tiny_chat_head):
    """Per configuration: one batch of the schema suite (greedy, then sampled), the regex, EBNF and JSON-object
    requests, and unconstrained requests; and the unconstrained requests alone."""
    from specserve.llm import LLM

    results = {}
    for name, shape in CONFIGS.items():
        spec = {"spec": SpecConfig("EAGLE3", str(tiny_chat_head), *shape)} if shape else {}
        llm = LLM(model=str(tiny_chat_model), max_total_tokens=16384, **spec)
        every = list(range(len(SCHEMAS)))
        prompts = [prompt(i) for i in every + SAMPLED[name]]
        params = schema_params(0.0, every) + schema_params(1.0, SAMPLED[name])
        mixed = run(llm, prompts + ["Answer yes or no."] * 3 + FREE_PROMPTS,
                    params + GRAMMAR_PARAMS + [FREE] * len(FREE_PROMPTS))
        mixed = (mixed[:len(prompts)], mixed[len(prompts):])
        alone = run(llm, FREE_PROMPTS, [FREE] * len(FREE_PROMPTS))
        results[name] = (mixed, alone)
    return results


@pytest.mark.parametrize("config", CONFIGS)
def test_every_output_is_valid_under_its_schema(runs, config):
    (schema_outputs, _), _ = runs[config]
    for i, out in zip(list(range(len(SCHEMAS))) + SAMPLED[config], schema_outputs, strict=True):
        jsonschema.validate(json.loads(out.text), SCHEMAS[i])
        assert out.finish_reason == "stop", (i, out.text)


@pytest.mark.parametrize("config", CONFIGS)
def test_regex_ebnf_and_json_object_outputs_match(runs, config):
    (_, others), _ = runs[config]
    regex, ebnf, json_object = others[:3]
    assert re.fullmatch(REGEX, regex.text), regex.text
    assert re.fullmatch(r"\((?:[a-c]|[0-9]{1,2})(?:,(?:[a-c]|[0-9]{1,2})){0,3}\)", ebnf.text), ebnf.text
    assert ebnf.finish_reason == "stop", "the grammar's end stops the request even under ignore_eos"
    assert json_object.finish_reason == "length" or isinstance(json.loads(json_object.text), dict)


@pytest.mark.parametrize("config", ["chain", "tree"])
def test_greedy_with_speculation_equals_greedy_without(runs, config):
    (spec_schemas, spec_others), _ = runs[config]
    (plain_schemas, plain_others), _ = runs["off"]
    greedy = len(SCHEMAS)
    assert [o.token_ids for o in spec_schemas[:greedy]] == [o.token_ids for o in plain_schemas[:greedy]]
    assert spec_others[0].token_ids == plain_others[0].token_ids  # the regex
    assert sum(o.num_spec_steps for o in spec_schemas) > 0


@pytest.mark.parametrize("config", CONFIGS)
def test_unconstrained_requests_are_unaffected_by_constrained_ones(runs, config):
    (_, others), alone = runs[config]
    assert [o.token_ids for o in others[-len(FREE_PROMPTS):]] == [o.token_ids for o in alone]
    assert [o.token_ids for o in alone] == [o.token_ids for o in runs["off"][1]]


def test_the_offline_api_takes_sglangs_field_names(tiny_chat_model):
    from specserve.llm import LLM

    llm = LLM(model=str(tiny_chat_model), max_total_tokens=2048)
    out = llm.generate("Answer:", SamplingParams(max_tokens=40, temperature=0.0, regex=REGEX))[0]
    assert re.fullmatch(REGEX, out.text)
    out = llm.generate("JSON:", SamplingParams(max_tokens=120, temperature=0.0, json_schema=SCHEMAS[0]))[0]
    jsonschema.validate(json.loads(out.text), SCHEMAS[0])


def test_an_invalid_grammar_is_refused_at_admission(tiny_chat_model):
    from specserve.llm import LLM

    llm = LLM(model=str(tiny_chat_model), max_total_tokens=2048)
    bad = SamplingParams(constraint=Constraint("json_schema", '{"type": "object", "properties": 3}'))
    with pytest.raises(ValueError, match="invalid json schema"):
        llm.engine.add_request("bad", [1, 2, 3], bad)
    assert not llm.engine.has_work()
