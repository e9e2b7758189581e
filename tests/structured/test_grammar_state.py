"""The grammar state on its own: masks against xgrammar's matcher, rollback, draft trees, the compile cache,
and the bit unpacking that applies the masks."""
from __future__ import annotations

import json
import random

import pytest
import torch

from specserve.bench.schemas import SCHEMAS
from specserve.core import Constraint, SamplingParams
from specserve.sampling.grammar_mask import allowed_tokens, mask_logits
from specserve.structured.grammar import Grammars

VOCAB = 49152  # the tiny chat model shares SmolLM2's vocabulary
EOS = 2


@pytest.fixture(scope="module")
def grammars(tiny_chat_model):
    from transformers import AutoTokenizer

    return Grammars(lambda: AutoTokenizer.from_pretrained(str(tiny_chat_model)), VOCAB, (EOS,), cache_size=4)


def schema(i: int) -> Constraint:
    return Constraint("json_schema", json.dumps(SCHEMAS[i]))


def allowed(mask: torch.Tensor) -> list[int]:
    return allowed_tokens(mask, VOCAB)[0].nonzero()[:, 0].tolist()


def random_walk(state, rng: random.Random, length: int) -> list[int]:
    """Tokens the grammar allows, drawn one after another (ending early at a stop token)."""
    tokens = []
    for _ in range(length):
        choices = allowed(state.next_mask())
        token = rng.choice(choices)
        assert state.accept(token)
        tokens.append(token)
        if state.terminated:
            break
    return tokens


def test_bit_unpacking_matches_the_bit_order():
    masks = torch.randint(-2**31, 2**31 - 1, (3, 5), dtype=torch.int32)
    expected = ((masks[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).view(3, -1).bool()
    assert torch.equal(allowed_tokens(masks, 150), expected[:, :150])
    for dtype in (torch.float32, torch.bfloat16):
        logits = torch.randn(3, 150, dtype=dtype)
        masked = mask_logits(logits, [masks[0:1], None, masks[2:3]])
        assert torch.equal(masked[1], logits[1]) and masked.dtype == dtype
        assert torch.equal(masked[0] == float("-inf"), ~expected[0, :150])
        assert torch.equal(masked[2] == float("-inf"), ~expected[2, :150])
        assert torch.equal(masked[expected[:, :150]], logits[expected[:, :150]])
        assert not (logits == float("-inf")).any(), "the input is left as it was"


@pytest.mark.parametrize("index", [0, 13, 16, 20])
def test_rollback_equals_a_fresh_matcher_fed_the_prefix(grammars, index):
    rng = random.Random(index)
    state = grammars.state(schema(index))
    walk = random_walk(state, rng, 30)
    for kept in sorted(rng.sample(range(len(walk)), min(4, len(walk))), reverse=True):
        state.rollback(len(walk) - kept)
        walk = walk[:kept]
        fresh = grammars.state(schema(index))
        assert all(fresh.accept(t) for t in walk)
        assert torch.equal(state.next_mask(), fresh.next_mask())
        assert state.terminated == fresh.terminated


def test_path_and_tree_masks_leave_the_state_unchanged(grammars):
    rng = random.Random(1)
    state = grammars.state(schema(16))
    prefix = random_walk(state, rng, 6)
    before = state.next_mask()
    probe = grammars.state(schema(16))
    assert all(probe.accept(t) for t in prefix)
    a = rng.choice(allowed(before))
    assert probe.accept(a)
    b = rng.choice(allowed(probe.next_mask()))
    forbidden = next(t for t in range(VOCAB) if t not in set(allowed(before)))
    # root, then: a, a -> b, a sibling the grammar forbids, and a child of that forbidden node
    tokens, parents = [prefix[-1], a, b, forbidden, a], [-1, 0, 1, 0, 3]
    tree = state.tree_masks(tokens, parents)
    paths = state.path_masks([[], [a], [a, b], [forbidden], [forbidden, a]])
    assert torch.equal(tree[:3], paths[:3])
    assert torch.equal(tree[0:1], before)
    assert (tree[3:] == -1).all() and (paths[3:] == -1).all(), "unreachable nodes' rows are left unconstrained"
    assert torch.equal(state.next_mask(), before)


def test_compiled_grammars_are_cached_by_text_with_a_bound(grammars):
    first = grammars.compile(schema(0))
    assert grammars.compile(Constraint("json_schema", json.dumps(SCHEMAS[0]))) is first
    for i in range(1, 6):
        grammars.compile(schema(i))
    assert len(grammars._cache) == grammars.cache_size
    assert grammars.compile(schema(0)) is not first  # evicted, compiled again


@pytest.mark.parametrize("constraint, words", [
    (Constraint("json_schema", "{not json"), "invalid json schema"),
    (Constraint("json_schema", '{"type": "strin"}'), "invalid json schema"),
    (Constraint("regex", "a(b"), "invalid regex"),
    (Constraint("ebnf", "root ::= missing_rule"), "invalid ebnf"),
])
def test_invalid_grammars_raise_value_errors(grammars, constraint, words):
    with pytest.raises(ValueError, match=words):
        grammars.compile(constraint)


def test_constraints_check_their_fields():
    with pytest.raises(ValueError, match="constraint kind"):
        Constraint("xml", "<a/>")
    with pytest.raises(ValueError, match="needs its text"):
        Constraint("regex")
    params = SamplingParams(constraint=Constraint("json_object"))
    assert params.needs_host_logits and hash(params) == hash(SamplingParams(constraint=Constraint("json_object")))


def test_sglang_field_names_become_the_constraint():
    """SGLang's sampling-params names (json_schema as text or a dict, regex, ebnf) are the constraint, one at a
    time; the params then hold one form, so `replace` keeps them valid."""
    from dataclasses import replace

    schema = {"type": "integer", "minimum": 3}
    params = SamplingParams(json_schema=schema, max_tokens=8)
    assert params.constraint == Constraint("json_schema", json.dumps(schema)) and params.json_schema is None
    assert params == SamplingParams(max_tokens=8, constraint=Constraint("json_schema", json.dumps(schema)))
    assert replace(params, max_tokens=4).constraint == params.constraint
    assert SamplingParams(regex="a+").constraint == Constraint("regex", "a+")
    assert SamplingParams(ebnf='root ::= "a"').constraint == Constraint("ebnf", 'root ::= "a"')
    with pytest.raises(ValueError, match="one output constraint, got regex, ebnf"):
        SamplingParams(regex="a+", ebnf='root ::= "a"')
    with pytest.raises(ValueError, match="one output constraint, got regex, constraint"):
        SamplingParams(regex="a+", constraint=Constraint("json_object"))


def test_masks_filled_on_threads_equal_those_filled_in_turn(grammars, monkeypatch):
    """`run_jobs` hands a large batch's mask fills (one request's grammar per job) to host threads: every
    mask is the one filled in turn, in order, and each state is left as it was."""
    import threading

    from specserve.structured import step_masks

    monkeypatch.setattr(step_masks, "_FILL_THREADS", 3)
    monkeypatch.setattr(step_masks, "_fill_pool", None)
    rng = random.Random(0)
    states, paths = [], []
    for i in range(step_masks.PARALLEL_MIN_JOBS + 5):
        state = grammars.state(schema(i % len(SCHEMAS)))
        random_walk(state, rng, 3)
        walk = [] if state.terminated else random_walk(state, rng, 2)
        state.rollback(len(walk))
        states.append(state)
        paths.append([walk[:j] for j in range(len(walk) + 1)])
    threads = set()

    def fill(state, state_paths):
        threads.add(threading.get_ident())
        return state.path_masks(state_paths)
    expected = [state.path_masks(p) for state, p in zip(states, paths)]
    filled = step_masks.run_jobs([lambda s=s, p=p: fill(s, p) for s, p in zip(states, paths)])
    assert all(torch.equal(a, b) for a, b in zip(filled, expected, strict=True))
    assert threads and threading.get_ident() not in threads
    assert all(torch.equal(s.path_masks([[]]), e[:1]) for s, e in zip(states, expected))


def test_a_failed_fill_is_raised_once_every_thread_is_done(monkeypatch):
    """A step whose masks fail is given up, and retried: no thread may still be on a grammar by then."""
    import time

    from specserve.structured import step_masks

    monkeypatch.setattr(step_masks, "_FILL_THREADS", 3)
    monkeypatch.setattr(step_masks, "_fill_pool", None)
    done = []

    def slow(i):
        time.sleep(0.05)
        done.append(i)

    def fail():
        raise RuntimeError("bad grammar")
    jobs = [fail] + [lambda i=i: slow(i) for i in range(step_masks.PARALLEL_MIN_JOBS)]
    with pytest.raises(RuntimeError, match="bad grammar"):
        step_masks.run_jobs(jobs)
    # Once a job fails no thread takes another; the jobs already taken end before the failure is raised.
    finished = sorted(done)
    time.sleep(0.2)
    assert sorted(done) == finished and len(finished) < step_masks.PARALLEL_MIN_JOBS


def test_a_long_fill_does_not_hold_the_jobs_behind_it(monkeypatch):
    """Threads take the next job not taken: two long fills side by side run on two threads, and the short
    jobs go to the threads that are free."""
    import threading
    import time

    from specserve.structured import step_masks

    monkeypatch.setattr(step_masks, "_FILL_THREADS", 3)
    monkeypatch.setattr(step_masks, "_fill_pool", None)
    ran_on = {}

    def job(i, seconds):
        time.sleep(seconds)
        ran_on[i] = threading.get_ident()
        return i
    jobs = [lambda i=i: job(i, 0.3 if i < 2 else 0.001) for i in range(step_masks.PARALLEL_MIN_JOBS + 8)]
    assert step_masks.run_jobs(jobs) == list(range(len(jobs)))
    assert ran_on[0] != ran_on[1]
    short_threads = {ran_on[i] for i in range(2, len(jobs))}
    assert ran_on[0] not in short_threads or ran_on[1] not in short_threads
