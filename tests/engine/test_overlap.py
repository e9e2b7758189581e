"""Overlap scheduling: step N+1 is launched before step N is read back, with placeholders for N's tokens.

It is on by default only on a GPU (on a CPU the host computes the step itself, so nothing overlaps); here it
is forced on, so the bookkeeping is checked where CI runs: outputs, stop conditions, usage counts, aborts,
failures and pages must be exactly what they are without it.
"""
from __future__ import annotations

import pytest
from engine_runs import hf_greedy, make_prompts, run_staggered, tight_config

from specserve.engine.factory import build_engine_core
from specserve.llm import LLM
from specserve.core import SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]


def _engine(config, overlap: bool):
    engine, _ = build_engine_core(config, progress=False)
    engine.overlap = overlap
    return engine


def _pages_all_free(engine) -> bool:
    alloc = engine.scheduler.allocator
    alloc.check_invariants()
    return alloc.num_free == alloc.num_pages


@pytest.mark.parametrize("kind", ["llama", "qwen3-moe", "deepseek-v3"])
def test_greedy_with_overlap_matches_transformers_under_preemption(tiny_checkpoint, kind):
    path = tiny_checkpoint(kind, False)
    prompts = make_prompts(512)
    engine = _engine(tight_config(str(path), max_total_tokens=200), overlap=True)
    ours, _ = run_staggered(engine, prompts)
    assert ours == hf_greedy(path, prompts)
    assert engine.scheduler.num_preemptions > 0
    assert _pages_all_free(engine) and engine.in_flight is None


@pytest.fixture(scope="module")
def llms(tiny_chat_model):
    def make(overlap: bool) -> LLM:
        llm = LLM(model=str(tiny_chat_model), max_total_tokens=2048, page_size=8)
        llm.engine.overlap = overlap
        return llm
    return make(False), make(True)


def _run(llm: LLM, prompts, params):
    outs = llm.generate(prompts, params)
    return [(o.token_ids, o.finish_reason, o.text) for o in outs]


def test_stop_conditions_and_usage_match_the_synchronous_engine(llms):
    plain, overlapped = llms
    full = plain.generate(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))[0]
    stop_token = full.token_ids[5]
    stop_text = full.text[len(full.text) // 2: len(full.text) // 2 + 3]
    cases = [
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_token]),
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop_text]),
        SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True),
    ]
    for params in cases:
        assert _run(overlapped, PROMPTS, params) == _run(plain, PROMPTS, params), params
        assert _pages_all_free(overlapped.engine) and not overlapped.engine.has_work()
    overlapped.add(PROMPTS[1], SamplingParams(max_tokens=20, temperature=0.0, stop_token_ids=[stop_token]))
    deltas = []
    while overlapped.engine.has_work():
        deltas += overlapped.engine.step()
    # Usage counts what was emitted, not the token already computed for the step launched after the stop.
    assert deltas[-1].num_output_tokens == full.token_ids.index(stop_token) + 1


def test_eos_stops_with_overlap(llms):
    plain, overlapped = llms
    full = plain.generate(PROMPTS[2], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    overlapped.engine.eos_token_ids = frozenset({full.token_ids[4]})
    try:
        out = overlapped.generate(PROMPTS[2], SamplingParams(max_tokens=12, temperature=0.0))[0]
    finally:
        overlapped.engine.eos_token_ids = plain.engine.eos_token_ids
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: full.token_ids.index(full.token_ids[4]) + 1]
    assert _pages_all_free(overlapped.engine)


def test_abort_with_a_step_in_flight_frees_everything(llms):
    _, overlapped = llms
    engine = overlapped.engine
    tracker = overlapped.add(PROMPTS[0], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    emitted = 0
    for _ in range(4):
        emitted += sum(len(d.new_token_ids) for d in engine.step())
    assert engine.in_flight is not None
    (aborted,) = engine.abort([tracker.output.request_id])
    assert aborted.finish_reason == "abort" and aborted.num_output_tokens == emitted
    assert engine.step() == []  # the step in flight is read back and its token dropped
    assert _pages_all_free(engine) and not engine.has_work()


def test_a_failing_request_fails_alone_with_overlap(llms):
    plain, overlapped = llms
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
    poison = overlapped.tokenizer.encode(PROMPTS[1])[0]
    runner = overlapped.engine.runner
    real_launch = runner.launch

    def flaky_launch(batch, publish=False):
        if any(poison in s.token_ids for s in batch.seqs):
            raise RuntimeError("injected fault")
        return real_launch(batch, publish)

    runner.launch = flaky_launch
    try:
        outs = overlapped.generate(PROMPTS, params)
    finally:
        runner.launch = real_launch
    assert outs[1].finish_reason == "error"
    assert [outs[0].token_ids, outs[2].token_ids] == [expected[0], expected[2]]
    assert _pages_all_free(overlapped.engine)


def test_a_request_that_fills_the_context_gets_no_step_past_its_last_token(tiny_chat_model):
    # Its last token is still being sampled when the next step is scheduled; scheduling it again would be a
    # wasted step, and one past the context if that token were known.
    results = []
    for overlap in (False, True):
        llm = LLM(model=str(tiny_chat_model), max_total_tokens=512, page_size=8, context_length=40)
        llm.engine.overlap = overlap
        runner, launches = llm.engine.runner, []
        real_launch = runner.launch
        runner.launch = lambda batch, publish=False: launches.append(batch) or real_launch(batch, publish)
        out = llm.generate(PROMPTS[0], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))[0]
        results.append((out.token_ids, out.finish_reason, len(launches)))
        assert _pages_all_free(llm.engine)
    assert results[1] == results[0] and results[0][1] == "length"
    assert len(results[0][0]) + len(llm.tokenizer.encode(PROMPTS[0])) == 40


def test_prefill_chunks_and_usage_counts_step_by_step_match_the_synchronous_engine(tiny_chat_model):
    """Chunks that sample nothing launch with overlap like any step (no one-by-one retry), and every delta
    counts the outputs emitted so far, not the placeholder of the step already in flight."""
    prompt = list(range(100, 160))
    params = SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)
    runs = []
    for overlap in (False, True):
        llm = LLM(model=str(tiny_chat_model), max_total_tokens=512, page_size=8, chunked_prefill_size=16)
        engine = llm.engine
        engine.overlap = overlap

        def no_retry(batch):
            raise AssertionError("a step fell back to running its requests one by one")
        engine._step_each_alone = no_retry
        engine.add_request("a", prompt, params)
        deltas = []
        while engine.has_work():
            deltas += [(d.new_token_ids, d.num_output_tokens, d.finish_reason) for d in engine.step()]
        runs.append(deltas)
        assert _pages_all_free(engine)
    assert runs[1] == runs[0]
    assert [count for _, count, _ in runs[0]] == list(range(1, 10))


@pytest.mark.parametrize("kind,algorithm", [("llama", "EAGLE3"), ("llama", "DRAFT_MODEL"), ("qwen3-moe", "EAGLE3"),
                                            ("deepseek-v3", "EAGLE3")])
def test_steps_that_draft_read_back_first_and_the_rest_overlap(tiny_checkpoint, tmp_path, kind, algorithm):
    """Speculation configured with a plan that drafts on some steps only: the other steps overlap, and a
    drafting step first reads the step in flight back; greedy output still equals HF, under preemption (the
    MoE and MLA targets too)."""
    import random
    from dataclasses import replace

    from tiny_checkpoints import write_peaked_random_head

    from specserve.config import SpecConfig

    path = tiny_checkpoint(kind, True)
    draft = write_peaked_random_head(path, tmp_path) if algorithm == "EAGLE3" else path
    config = replace(tight_config(str(path), max_total_tokens=200), spec=SpecConfig(algorithm, str(draft), 3))
    engine = _engine(config, overlap=True)
    rng = random.Random(0)
    engine.scheduler.draft_plan = lambda request: rng.choice([0, 0, 3])
    overlapped, launch = [], engine.runner.launch
    engine.runner.launch = lambda batch, publish=False: overlapped.append(publish) or launch(batch, publish)
    prompts = make_prompts(512)  # seed 3's prompts hit an fp32 near-tie with HF on any path, overlap or not
    outputs, _ = run_staggered(engine, prompts)
    assert outputs == hf_greedy(path, prompts)
    assert sum(overlapped) > 3 and len(overlapped) - sum(overlapped) > 10  # both kinds of step happened
    assert engine.scheduler.num_preemptions > 0
    assert _pages_all_free(engine) and engine.in_flight is None


def test_a_request_that_stops_on_the_token_read_back_before_a_drafting_step(tiny_chat_model):
    """With a draft model that is the target itself, drafting steps follow overlapped ones. A request whose
    token read back just before a drafting step is a stop token is dropped from that step; the others get
    the tokens read back in place of their placeholders. Output and finish reasons equal the synchronous
    engine's, and no page is left behind."""
    from specserve.config import SpecConfig

    params_full = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    runs = []
    for overlap in (False, True):
        llm = LLM(model=str(tiny_chat_model), max_total_tokens=2048, page_size=8,
                  spec=SpecConfig("DRAFT_MODEL", str(tiny_chat_model), 2))
        engine = llm.engine
        engine.overlap = overlap
        full = llm.generate(PROMPTS, params_full)
        steps = {"n": 0}
        schedule = engine.scheduler.schedule

        def every_other_step_drafts():
            steps["n"] += 1
            return schedule()
        engine.scheduler.schedule = every_other_step_drafts
        engine.scheduler.draft_plan = lambda request: 2 if steps["n"] % 2 else 0
        mapped, dropped, with_known = [], [], engine._with_known_tokens

        def known_tokens(batch):
            mapped.append(bool(engine._known))
            kept = with_known(batch)
            dropped.append(len(batch.seqs) - len(kept.seqs))
            return kept
        engine._with_known_tokens = known_tokens
        # Each prompt stops at a token it produces at a different point, some on overlapped steps.
        stops = [out.token_ids[3 + i] for i, out in enumerate(full)]
        outs = [llm.generate(p, SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=[stop]))[0]
                for p, stop in zip(PROMPTS, stops)]
        together = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=stops))
        runs.append(([(o.token_ids, o.finish_reason) for o in outs + together]))
        assert _pages_all_free(engine) and not engine.has_work()
        if overlap:
            assert any(mapped)  # drafting steps did follow steps in flight
            assert sum(dropped) > 0  # and some requests stopped on the token read back just before one
    assert runs[1] == runs[0]
    assert all(reason == "stop" for _, reason in runs[0])
