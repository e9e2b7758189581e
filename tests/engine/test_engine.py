"""Engine behaviour through the offline API: stop conditions, seeds, aborts, and fault isolation."""
from __future__ import annotations

import weakref

import pytest

from specserve.engine.output import Detokenizer, find_stop
from specserve.llm import LLM
from specserve.core import SamplingParams

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,"]


@pytest.fixture(scope="module")
def llm(tiny_chat_model):
    return LLM(model=str(tiny_chat_model), max_total_tokens=2048, page_size=8)


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def _pages_all_free(llm: LLM) -> bool:
    alloc = llm.engine.scheduler.allocator
    alloc.check_invariants()
    return alloc.num_free == alloc.num_pages


def test_stop_string_cuts_the_text_and_frees_pages(llm):
    full = llm.generate(PROMPTS[0], _greedy(30))[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 30
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 3]
    cut = llm.generate(PROMPTS[0], _greedy(30, stop=[stop]))[0]
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[: full.text.index(stop)]
    assert len(cut.token_ids) < 30
    assert _pages_all_free(llm)


def test_stop_token_ids_and_max_tokens(llm):
    full = llm.generate(PROMPTS[1], _greedy(20))[0]
    stop_token = full.token_ids[5]
    out = llm.generate(PROMPTS[1], _greedy(20, stop_token_ids=[stop_token]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == full.token_ids[: full.token_ids.index(stop_token) + 1]
    assert llm.generate(PROMPTS[1], _greedy(7))[0].token_ids == full.token_ids[:7]


def test_eos_ends_generation_unless_ignored(llm):
    full = llm.generate(PROMPTS[2], _greedy(12))[0]
    real_eos = llm.engine.eos_token_ids
    llm.engine.eos_token_ids = frozenset({full.token_ids[4]})  # make a token we know will come the EOS
    try:
        stopped = llm.generate(PROMPTS[2], SamplingParams(max_tokens=12, temperature=0.0))[0]
        ignored = llm.generate(PROMPTS[2], _greedy(12))[0]
    finally:
        llm.engine.eos_token_ids = real_eos
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full.token_ids[: full.token_ids.index(full.token_ids[4]) + 1]
    assert ignored.token_ids == full.token_ids and ignored.finish_reason == "length"


def test_seed_makes_sampling_repeatable_whatever_the_batch(llm):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=1234, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], params)[0].token_ids
    together = llm.generate(PROMPTS, params)[0].token_ids
    assert alone == together
    other_seed = SamplingParams(max_tokens=12, temperature=1.0, seed=99, ignore_eos=True)
    assert llm.generate(PROMPTS[0], other_seed)[0].token_ids != alone


def test_abort_frees_pages(llm):
    tracker = llm.add(PROMPTS[0], _greedy(50))
    for _ in range(3):
        llm.step_and_track([tracker])
    assert not _pages_all_free(llm)
    aborted = llm.engine.abort([tracker.output.request_id])
    assert aborted[0].finish_reason == "abort"
    assert _pages_all_free(llm) and not llm.engine.has_work()


def test_a_failing_request_fails_alone(llm):
    expected = [o.token_ids for o in llm.generate(PROMPTS, _greedy(8))]
    poison = llm.tokenizer.encode(PROMPTS[1])[0]
    real_launch = llm.engine.runner.launch

    def flaky_launch(batch, publish=False):
        if any(poison in s.token_ids for s in batch.seqs):
            raise RuntimeError("injected fault")
        return real_launch(batch, publish)

    llm.engine.runner.launch = flaky_launch
    try:
        outs = llm.generate(PROMPTS, _greedy(8))
    finally:
        llm.engine.runner.launch = real_launch
    assert outs[1].finish_reason == "error"
    assert [outs[0].token_ids, outs[2].token_ids] == [expected[0], expected[2]]
    assert _pages_all_free(llm)
    assert llm.generate(PROMPTS[1], _greedy(8))[0].token_ids == expected[1]  # the engine is still fine


def test_prompt_steps_that_run_out_of_memory_cap_the_prompt_tokens_of_later_steps(tiny_chat_model):
    # A device out of memory for a step's prompts: the step's requests are retried one by one, as for any
    # fault, and later steps take fewer prompt tokens, so the next wave does not fail again.
    import torch

    llm = LLM(model=str(tiny_chat_model), max_total_tokens=4096, page_size=8)
    prompts = [f"{p} {i}" for i in range(4) for p in PROMPTS]
    expected = [o.token_ids for o in llm.generate(prompts, _greedy(6))]
    limit, failures = 40, []
    real_launch = llm.engine.runner.launch

    def small_device(batch, publish=False):
        prompt_tokens = sum(len(s.token_ids) for s in batch.seqs if len(s.token_ids) > 1)
        if prompt_tokens > limit:
            failures.append(prompt_tokens)
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        return real_launch(batch, publish)

    llm.engine.runner.launch = small_device
    outs = llm.generate(prompts, _greedy(6)) + llm.generate(prompts, _greedy(6))
    assert [o.token_ids for o in outs] == expected * 2 and all(o.finish_reason == "length" for o in outs)
    cap = llm.engine.scheduler.prompt_token_cap
    assert cap is not None and cap <= limit
    assert failures and failures == sorted(failures, reverse=True) and len(failures) <= 3  # halved until it fit
    assert _pages_all_free(llm)


def test_incremental_detokenization_equals_full_decode(llm):
    text = "Héllo wörld — 你好, emoji 🙂 done."
    ids = llm.tokenizer.encode(text)
    detok = Detokenizer(llm.tokenizer, SamplingParams())
    pieces = [detok.push([t]) for t in ids]
    assert "".join(pieces) == llm.tokenizer.decode(ids) == detok.text
    assert all("\ufffd" not in p for p in pieces)


def test_find_stop_looks_only_where_new_text_can_complete_a_stop():
    assert find_stop("abc STOP", 3, ("STOP",)) == 4
    assert find_stop("STOP and more", 4, ("STOP",)) is None  # already seen before this delta
    assert find_stop("xx ab", 2, ("ab", "b")) == 3


def test_speculative_run_past_a_stop_string_keeps_no_tokens_after_it(tiny_chat_model):
    from specserve.config import SpecConfig

    spec_llm = LLM(model=str(tiny_chat_model), max_total_tokens=2048, spec=SpecConfig("DRAFT_MODEL", str(tiny_chat_model), 6))
    full = spec_llm.generate(PROMPTS[0], _greedy(40))[0]
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 3]
    cut = spec_llm.generate(PROMPTS[0], _greedy(40, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == full.text[: full.text.index(stop)]
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]
    decoded = spec_llm.tokenizer.decode(cut.token_ids, skip_special_tokens=True)
    assert stop in decoded and stop not in spec_llm.tokenizer.decode(cut.token_ids[:-1], skip_special_tokens=True)


@pytest.mark.parametrize("prompt, params", [
    ([1, 2, 10**6], SamplingParams()),
    ([1, -5, 3], SamplingParams()),
    ([1, 2, 3], SamplingParams(logit_bias={10**6: 1.0})),
])
def test_token_ids_outside_the_vocabulary_are_refused_at_admission(llm, prompt, params):
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([prompt], params)
    assert not llm.engine.has_work() and _pages_all_free(llm)


def test_close_frees_the_engine_before_the_llm_object_goes(tiny_chat_model):
    """Benchmarks build engines in turn: the one before must not hold its weights and KV pool meanwhile."""
    closing = LLM(model=str(tiny_chat_model), max_total_tokens=256, page_size=8)
    model = weakref.ref(closing.engine.runner.model)
    kv_cache = weakref.ref(closing.engine.runner.kv_cache)
    closing.close()
    assert model() is None and kv_cache() is None
