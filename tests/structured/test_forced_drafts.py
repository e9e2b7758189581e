"""Grammar-forced tokens verified as drafts (engine/scheduler.py `_forced_span`): the span a grammar forces is
the tokens it allows one at a time; the scheduler reserves pages for it; greedy output with forced drafts, with
speculation off, as a chain and as a tree, equals plain greedy without them under the same grammar, in fewer
steps; sampled outputs stay valid and unconstrained requests in the batch are unaffected."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from specserve import envs
from specserve.config import SchedulerConfig, SpecConfig
from specserve.core import Constraint, FinishReason, Request, SamplingParams
from specserve.engine.scheduler import MAX_FORCED_TOKENS, Scheduler
from specserve.kv.pages import PageAllocator
from specserve.sampling.grammar_mask import allowed_tokens
from specserve.structured.grammar import Grammars
from engine_runs import run_batch

VOCAB = 49152  # the tiny chat model shares SmolLM2's vocabulary
# Long literal runs between short free fields: most tokens are forced.
REGEX = r'\{"name": "[a-z]{1,6}", "address": \{"street": "[a-z]{1,8}", "city": "[a-z]{1,8}"\}, "ok": (true|false)\}'
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["identifier", "description", "tags"],
          "properties": {"identifier": {"type": "integer", "minimum": 0, "maximum": 99},
                         "description": {"type": "string", "maxLength": 12},
                         "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["alpha", "beta"]}}}}
GREEDY = [SamplingParams(max_tokens=80, temperature=0.0, constraint=Constraint("regex", REGEX)),
          SamplingParams(max_tokens=80, temperature=0.0, constraint=Constraint("json_schema", json.dumps(SCHEMA)))]
SAMPLED = [SamplingParams(max_tokens=80, temperature=1.0, seed=7, constraint=Constraint("regex", REGEX)),
           SamplingParams(max_tokens=80, temperature=1.0, seed=8,
                          constraint=Constraint("json_schema", json.dumps(SCHEMA)))]
FREE = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = ["Describe a person as JSON.", "Give me a record."]
CONFIGS = {"off": None, "chain": (3, 1, None), "tree": (3, 2, 6)}


@pytest.fixture(scope="module")
def grammars(tiny_chat_model):
    from transformers import AutoTokenizer

    return Grammars(lambda: AutoTokenizer.from_pretrained(str(tiny_chat_model)), VOCAB, (2,), cache_size=4)


def allowed(mask: torch.Tensor) -> list[int]:
    return allowed_tokens(mask, VOCAB)[0].nonzero()[:, 0].tolist()


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_chat_model))


def test_forced_tokens_are_the_forced_string_then_a_forced_stop(grammars, tokenizer):
    state = grammars.state(Constraint("regex", REGEX))
    before = state.next_mask()
    forced = state.forced_tokens(64)
    assert tokenizer.decode(forced) == '{"name": "' and torch.equal(state.next_mask(), before)
    assert state.forced_tokens(2) == forced[:2]
    probe = grammars.state(Constraint("regex", REGEX))
    assert all(probe.accept(t) for t in forced) and len(allowed(probe.next_mask())) > 1
    text = '{"name": "bob", "address": {"street": "main", "city": "rome"}, "ok": true'
    assert all(state.accept(t) for t in tokenizer.encode(text))
    closing = state.forced_tokens(64)
    assert closing[-1] == 2 and tokenizer.decode(closing[:-1]) == "}", "the stop token the grammar forces ends it"
    assert allowed(state.next_mask()) == [closing[0]]


def test_without_a_tokenizer_only_single_allowed_tokens_are_forced(grammars, tokenizer):
    from specserve.structured.state import GrammarState

    state = GrammarState(grammars.compile(Constraint("regex", REGEX)), VOCAB, (2,))
    assert state.forced_tokens(64) == []
    assert all(state.accept(t) for t in tokenizer.encode('{"name": "bob", "address": {"street": "main", '
                                                         '"city": "rome"}, "ok": true'))
    assert [tokenizer.decode(t) for t in state.forced_tokens(64)] == ["}", tokenizer.decode(2)]


class _ForcingGrammar:
    """Forces `span` tokens at every step (the scheduler only asks for the span)."""

    def __init__(self, span: int) -> None:
        self.span = span

    def forced_tokens(self, limit: int) -> list[int]:
        return [7] * min(self.span, limit)


def _decoding(scheduler: Scheduler, spans: dict[str, tuple[int, int]]) -> list[Request]:
    """Requests (id: forced span, max_tokens) past their prompts, each with one output token to compute."""
    requests = []
    for rid, (span, max_tokens) in spans.items():
        request = Request(rid, list(range(1, 9)), SamplingParams(max_tokens=max_tokens), max_tokens)
        request.grammar = _ForcingGrammar(span)
        scheduler.add(request)
        requests.append(request)
    scheduler.schedule()  # the prompts
    for request in requests:
        request.num_computed_tokens = request.num_tokens
        request.token_ids.append(5)  # its first output
    return requests


@pytest.mark.parametrize("end", ["finish", "abort"])
def test_forced_spans_get_pages_and_budget_and_give_them_back(end):
    allocator = PageAllocator(40, 4)
    scheduler = Scheduler(SchedulerConfig(chunked_prefill_size=24), allocator, max_model_len=128)
    requests = _decoding(scheduler, {"long": (30, 50), "short": (3, 3)})
    seqs = scheduler.schedule().seqs
    assert len(seqs[0].forced_token_ids) == MAX_FORCED_TOKENS  # bounded
    assert len(seqs[1].forced_token_ids) == 1  # max_tokens leaves room for one draft and the bonus token
    for request, seq in zip(requests, seqs):
        assert len(request.page_ids) == allocator.pages_for(request.num_computed_tokens + 1 + len(seq.forced_token_ids))
    tight = Scheduler(SchedulerConfig(chunked_prefill_size=16), PageAllocator(40, 4), max_model_len=128)
    _decoding(tight, {"a": (30, 50), "b": (30, 50)})
    assert [len(s.forced_token_ids) for s in tight.schedule().seqs] == [15], "the step's budget bounds spans"
    for request in requests:
        scheduler.finish(request, FinishReason.STOP) if end == "finish" else scheduler.abort(request.request_id)
    assert allocator.num_used == 0
    allocator.check_invariants()


def test_forced_drafts_switch_off_leaves_steps_as_they_were():
    scheduler = Scheduler(SchedulerConfig(), PageAllocator(40, 4), max_model_len=128)
    _decoding(scheduler, {"a": (5, 50)})
    with envs.override(forced_drafts=False):
        assert scheduler.schedule().seqs[0].forced_token_ids == []


def test_where_steps_replay_graphs_no_request_gets_a_span():
    """A span would send its step off the CUDA graphs (plain steps, the step programs) to an eager forward."""
    scheduler = Scheduler(SchedulerConfig(), PageAllocator(40, 4), max_model_len=128,
                          draft_plan=lambda request: 3 if request.request_id == "drafting" else 0,
                          max_draft_tokens=3, forced_spans=False)
    _decoding(scheduler, {"plain": (5, 50), "drafting": (2, 50)})
    seqs = {s.request_id: s for s in scheduler.schedule().seqs}
    assert seqs["plain"].forced_token_ids == [] and seqs["plain"].num_draft_tokens == 0
    assert seqs["drafting"].forced_token_ids == [] and seqs["drafting"].num_draft_tokens == 3


@pytest.fixture(scope="module")
def runs(tiny_chat_model, tiny_chat_head):
    """Per configuration and forced drafts on or off: the greedy requests alone (their steps), then a batch of
    the sampled requests with an unconstrained one."""
    from specserve.llm import LLM

    results = {}
    for name, shape in CONFIGS.items():
        spec = {"spec": SpecConfig("EAGLE3", str(tiny_chat_head), *shape)} if shape else {}
        llm = LLM(model=str(tiny_chat_model), max_total_tokens=4096, **spec)
        for forced in (True, False) if name == "off" else (True,):
            with envs.override(forced_drafts=forced):
                greedy = run_batch(llm, PROMPTS, GREEDY)
                mixed = run_batch(llm, PROMPTS + ["Tell me a story."], SAMPLED + [FREE])[0]
            results[name, forced] = (greedy, mixed, llm.engine.scheduler.allocator.num_used)
    return results


@pytest.mark.parametrize("config", CONFIGS)
def test_greedy_with_forced_drafts_equals_plain_greedy(runs, config):
    (outputs, steps), _, _ = runs[config, True]
    (plain, plain_steps), _, _ = runs["off", False]
    assert [o.token_ids for o in outputs] == [o.token_ids for o in plain]
    assert re.fullmatch(REGEX, plain[0].text) and plain[0].finish_reason == "stop"
    jsonschema.validate(json.loads(plain[1].text), SCHEMA)
    assert sum(o.num_accepted_tokens for o in outputs) > 0
    if config == "off":
        assert steps < plain_steps * 0.6, "forced spans take one step each"


@pytest.mark.parametrize("config", CONFIGS)
def test_sampled_outputs_stay_valid_and_free_requests_unaffected(runs, config):
    _, (regex, schema, free), pages = runs[config, True]
    _, (_, _, plain_free), _ = runs["off", False]
    assert re.fullmatch(REGEX, regex.text), regex.text
    jsonschema.validate(json.loads(schema.text), SCHEMA)
    assert free.token_ids == plain_free.token_ids
    assert pages == 0, "every page back after the batch"
