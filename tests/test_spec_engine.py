"""Speculative decoding inside continuous batching: greedy output with speculation equals the greedy
reference token for token, with a draft length that changes at every step and per request (0 included),
under staggered arrivals, chunked prefill and preemption; and no page leaks."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from specserve.config import SpecConfig
from specserve.engine.factory import build_engine_core

from conftest import write_tiny_checkpoint
from test_greedy_vs_hf import _engine_greedy, _hf_greedy, _prompts, _tight_config, run_staggered


@pytest.fixture(scope="module")
def unrelated_draft(tmp_path_factory):
    path = tmp_path_factory.mktemp("draft-unrelated")
    write_tiny_checkpoint("llama", path, seed=123)  # same shape and vocab, different weights: few accepts
    return path


def _spec_engine(target, draft, num_steps: int, max_total_tokens: int = 136):
    config = replace(_tight_config(str(target), max_total_tokens),
                     spec=SpecConfig("DRAFT_MODEL", str(draft), num_steps))
    engine, _ = build_engine_core(config, progress=False)
    return engine


@pytest.mark.parametrize("draft_kind", ["copy", "unrelated"])
@pytest.mark.parametrize("num_steps", [1, 3, 5])
def test_greedy_with_speculation_matches_the_reference(tiny_checkpoint, unrelated_draft, draft_kind, num_steps):
    target = tiny_checkpoint("llama", True)
    draft = target if draft_kind == "copy" else unrelated_draft
    prompts = _prompts(512)
    reference = _hf_greedy(target, prompts)
    engine = _spec_engine(target, draft, num_steps)
    ours, steps = run_staggered(engine, prompts)
    assert ours == reference
    assert engine.scheduler.num_preemptions > 0
    alloc = engine.scheduler.allocator
    assert alloc.num_free == alloc.num_pages
    alloc.check_invariants()
    if draft_kind == "copy" and num_steps >= 3:
        # A copy of the target is accepted almost always, so the same work takes far fewer steps.
        plain_engine, _ = build_engine_core(_tight_config(str(target), 200), progress=False)
        _, plain_steps = run_staggered(plain_engine, prompts)
        assert steps < 0.7 * plain_steps, (steps, plain_steps)


def test_draft_length_can_change_every_step_and_per_request(tiny_checkpoint):
    target = tiny_checkpoint("llama", True)
    prompts = _prompts(512, seed=3)
    reference, _ = _engine_greedy(_tight_config(str(target), 200), prompts)
    engine = _spec_engine(target, target, num_steps=4)
    rng = random.Random(0)
    engine.scheduler.draft_plan = lambda request: rng.choice([0, 0, 1, 2, 4, 7])
    ours, _ = run_staggered(engine, prompts)
    assert ours == reference
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_pages


def test_thousands_of_speculative_steps_leak_no_pages(tiny_checkpoint, unrelated_draft):
    target = tiny_checkpoint("llama", True)
    engine = _spec_engine(target, unrelated_draft, num_steps=3, max_total_tokens=160)
    rng = random.Random(1)
    engine.scheduler.draft_plan = lambda request: rng.choice([0, 1, 3, 6])
    from specserve.sampling_params import SamplingParams

    steps, added = 0, 0
    while steps < 2000:
        if added < 150 and rng.random() < 0.2:
            n = rng.randint(1, 30)
            engine.add_request(f"r{added}", [rng.randrange(3, 512) for _ in range(n)],
                               SamplingParams(max_tokens=rng.randint(1, 40), temperature=rng.choice([0.0, 1.0]),
                                              ignore_eos=True))
            added += 1
        if engine.has_work():
            engine.step()
            engine.scheduler.allocator.check_invariants()
        if rng.random() < 0.01 and engine.scheduler.requests:
            engine.abort([rng.choice(list(engine.scheduler.requests))])
        steps += 1
        if added >= 150 and not engine.has_work():
            break
    while engine.has_work():
        engine.step()
    alloc = engine.scheduler.allocator
    assert alloc.num_free == alloc.num_pages


def test_offline_api_reports_speculation_figures(tiny_checkpoint):
    from specserve.llm import LLM
    from specserve.sampling_params import SamplingParams

    target = tiny_checkpoint("llama", True)
    llm = LLM(model=str(target), max_total_tokens=1024, spec=SpecConfig("DRAFT_MODEL", str(target), 4))
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True))[0]
    # A copy of the target is always accepted: 1 prefill token, then 4 steps of 4 drafts + 1 bonus.
    assert len(out.token_ids) == 21
    assert out.num_spec_steps == 4 and out.num_drafted_tokens == 16 and out.num_accepted_tokens == 16
    assert out.mean_acceptance_length == 5.0
    plain = LLM(model=str(target), max_total_tokens=1024).generate([[5, 6, 7, 8]],
                                                                  SamplingParams(max_tokens=21, temperature=0.0))[0]
    assert plain.num_spec_steps == 0 and plain.mean_acceptance_length is None
