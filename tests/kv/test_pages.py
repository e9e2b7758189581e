"""Allocator and scheduler invariants. These modules must import without torch."""
from __future__ import annotations

import random
from dataclasses import replace
import subprocess
import sys

import pytest

from specserve.config import SchedulerConfig
from specserve.kv.pages import OutOfPages, PageAllocator
from specserve.core import FinishReason, Request, Status
from specserve.engine.scheduler import Scheduler
from specserve.core import StepBatch
from specserve.core import SamplingParams


def test_pure_python_modules_import_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import specserve, specserve.engine.scheduler, specserve.kv.pages, specserve.config\n"
        "print('ok')"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "ok", result.stderr


def test_allocator_never_hands_out_a_page_twice():
    alloc = PageAllocator(num_pages=8, page_size=4)
    a = alloc.allocate("a", 3)
    b = alloc.allocate("b", 5)
    assert not set(a) & set(b)
    with pytest.raises(OutOfPages):
        alloc.allocate("c", 1)
    alloc.check_invariants()
    with pytest.raises(RuntimeError):
        alloc.free("b", a)  # freeing someone else's pages is a bug, caught loudly
    alloc.free("a", a)
    alloc.free("b", b)
    assert alloc.num_free == 8
    alloc.check_invariants()


def _request(rid: str, prompt_len: int, max_tokens: int) -> Request:
    return Request(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens), max_tokens)


def _drive(scheduler: Scheduler, steps: int, rng: random.Random, aborts: float = 0.0) -> None:
    """Pretend to run the model: every scheduled sampling seq gets a token; finish at max_tokens."""
    for _ in range(steps):
        batch = scheduler.schedule()
        scheduler.allocator.check_invariants()
        owned = [p for r in scheduler.running for p in r.page_ids]
        assert len(owned) == len(set(owned)), "a page is owned by two requests"
        assert all(not r.page_ids for r in scheduler.waiting)
        for seq in batch.seqs:
            req = scheduler.requests[seq.request_id]
            # Pages cover exactly what this step computes, never less.
            assert len(req.page_ids) * scheduler.allocator.page_size >= seq.start_pos + len(seq.token_ids)
            req.num_computed_tokens += len(seq.token_ids)
            if seq.sample:
                req.token_ids.append(7)
                if req.num_output_tokens >= req.max_tokens:
                    scheduler.finish(req, FinishReason.LENGTH)
        if aborts and scheduler.requests and rng.random() < aborts:
            scheduler.abort(rng.choice(list(scheduler.requests)))


def test_every_page_comes_back_after_finish_abort_and_preemption():
    rng = random.Random(0)
    alloc = PageAllocator(num_pages=24, page_size=4)
    sched = Scheduler(SchedulerConfig(max_running_requests=6, chunked_prefill_size=32), alloc, max_model_len=96)
    for i in range(40):
        sched.add(_request(f"r{i}", rng.randint(1, 40), rng.randint(1, 30)))
    _drive(sched, 2000, rng, aborts=0.05)
    assert not sched.has_work()
    assert sched.num_preemptions > 0, "the pool is small enough that preemption must happen"
    assert alloc.num_free == alloc.num_pages
    alloc.check_invariants()


def test_chunked_prefill_respects_the_token_budget_and_running_cap():
    alloc = PageAllocator(num_pages=100, page_size=16)
    sched = Scheduler(SchedulerConfig(max_running_requests=2, chunked_prefill_size=10), alloc, max_model_len=512)
    for i in range(3):
        sched.add(_request(f"r{i}", 25, 4))
    batch = sched.schedule()
    assert batch.num_tokens == 10
    assert [s.request_id for s in batch.seqs] == ["r0"] and not batch.seqs[0].sample
    for seq in batch.seqs:
        sched.requests[seq.request_id].num_computed_tokens += len(seq.token_ids)
    batch = sched.schedule()
    assert [(s.request_id, len(s.token_ids)) for s in batch.seqs] == [("r0", 10)]
    for seq in batch.seqs:
        sched.requests[seq.request_id].num_computed_tokens += len(seq.token_ids)
    batch = sched.schedule()  # r0's last 5 tokens, then r1 joins with what budget is left
    assert [(s.request_id, len(s.token_ids), s.sample) for s in batch.seqs] == [("r0", 5, True), ("r1", 5, False)]
    assert len(sched.running) == 2 and sched.waiting[0].request_id == "r2"


def test_preempted_request_is_recomputed_from_scratch():
    alloc = PageAllocator(num_pages=4, page_size=4)
    sched = Scheduler(SchedulerConfig(max_running_requests=4, chunked_prefill_size=64), alloc, max_model_len=64)
    sched.add(_request("old", 7, 8))
    sched.add(_request("new", 7, 8))
    _drive(sched, 1, random.Random(0))
    assert {r.request_id for r in sched.running} == {"old", "new"}
    _drive(sched, 2, random.Random(0))  # the 9th token needs a third page: the pool has 2 x 2
    new = sched.requests["new"]
    assert new.status is Status.WAITING and new.num_computed_tokens == 0 and new.num_preemptions == 1
    assert new.num_output_tokens == 2  # what it generated stays; only its KV is dropped
    _drive(sched, 100, random.Random(0))
    assert alloc.num_free == alloc.num_pages


def test_requests_that_can_never_fit_are_refused_up_front():
    alloc = PageAllocator(num_pages=2, page_size=4)
    sched = Scheduler(SchedulerConfig(), alloc, max_model_len=64)
    with pytest.raises(ValueError):
        sched.add(_request("big", 6, 8))  # 14 tokens > 8 slots in the pool
    with pytest.raises(ValueError):
        Scheduler(SchedulerConfig(), PageAllocator(100, 4), max_model_len=16).add(_request("long", 10, 10))
    assert alloc.num_free == 2 and not sched.has_work()


def test_with_speculation_steps_draft_only_when_no_prompt_is_pending():
    """A drafting step holds decoding requests only (the chain program and its graphs take nothing else);
    while a prompt is pending, decoding requests still run in every step, without drafts, so they never wait
    on prompts. A prompt chunk carries its tokens for the drafter to extend over."""
    alloc = PageAllocator(num_pages=100, page_size=4)
    sched = Scheduler(SchedulerConfig(max_running_requests=4, chunked_prefill_size=12), alloc, max_model_len=512,
                      draft_plan=lambda request: 3, max_draft_tokens=3)

    def finish_step(batch):
        for seq in batch.seqs:
            request = sched.requests[seq.request_id]
            request.num_computed_tokens += len(seq.token_ids)
            if seq.draft_catchup_ids:
                request.num_draft_computed_tokens = seq.start_pos + len(seq.token_ids)
            if seq.sample:
                request.token_ids.append(7)

    sched.add(_request("a", 10, 20))
    batch = sched.schedule()
    assert [(s.request_id, len(s.token_ids), s.num_draft_tokens) for s in batch.seqs] == [("a", 10, 0)]
    assert batch.seqs[0].draft_catchup_ids == batch.seqs[0].token_ids and batch.seqs[0].draft_start_pos == 0
    finish_step(batch)
    sched.add(_request("b", 16, 20))
    steps, batches = [], []
    for _ in range(4):
        batch = sched.schedule()
        batches.append(batch)
        steps.append([(s.request_id, len(s.token_ids), s.num_draft_tokens) for s in batch.seqs])
        finish_step(batch)
    # a keeps decoding, without drafts, while b's prompt runs in two chunks; then both draft.
    assert steps == [[("a", 1, 0), ("b", 11, 0)], [("a", 1, 0), ("b", 5, 0)],
                     [("a", 1, 3), ("b", 1, 3)], [("a", 1, 3), ("b", 1, 3)]]
    # The drafter was extended over b's prompt chunks, so the first drafting step catches up on the token
    # sampled after the prompt alone.
    b_first_draft = batches[2].seqs[1]
    assert (b_first_draft.draft_start_pos, b_first_draft.draft_catchup_ids) == (16, [7])


def test_a_plan_that_drafts_nothing_leaves_the_drafter_idle_in_decode_steps():
    """Lazy catch-up: decode steps that draft nothing give the drafter nothing to do; only prompt chunks, and
    decoders in steps that pending prompts keep from drafting, carry catch-up tokens."""
    alloc = PageAllocator(num_pages=100, page_size=4)
    sched = Scheduler(SchedulerConfig(max_running_requests=4, chunked_prefill_size=12), alloc, max_model_len=512,
                      draft_plan=lambda request: 0, max_draft_tokens=3)
    sched.add(_request("a", 3, 20))
    batch = sched.schedule()
    assert batch.seqs[0].draft_catchup_ids == [1, 2, 3]
    sched.requests["a"].num_computed_tokens += 3
    sched.requests["a"].num_draft_computed_tokens = 3
    for _ in range(3):
        sched.requests["a"].token_ids.append(7)
        batch = sched.schedule()
        assert [(s.request_id, s.num_draft_tokens, s.draft_catchup_ids) for s in batch.seqs] == [("a", 0, [])]
        sched.requests["a"].num_computed_tokens += 1
    sched.requests["a"].token_ids.append(8)
    sched.add(_request("b", 5, 20))
    batch = sched.schedule()  # b's prompt is pending: a extends over its known tokens, all but the newest
    assert [(s.request_id, s.token_ids, s.draft_catchup_ids) for s in batch.seqs] == [
        ("a", [8], [7, 7, 7]), ("b", [1, 2, 3, 4, 5], [1, 2, 3, 4, 5])]


def test_without_speculation_prompt_chunks_and_decoding_share_steps():
    alloc = PageAllocator(num_pages=100, page_size=4)
    sched = Scheduler(SchedulerConfig(max_running_requests=4, chunked_prefill_size=12), alloc, max_model_len=512)
    sched.add(_request("a", 3, 20))
    batch = sched.schedule()
    sched.requests["a"].num_computed_tokens += 3
    sched.requests["a"].token_ids.append(7)
    sched.add(_request("b", 16, 20))
    batch = sched.schedule()
    assert [(s.request_id, len(s.token_ids)) for s in batch.seqs] == [("a", 1), ("b", 11)]
    assert all(not s.draft_catchup_ids for s in batch.seqs)


def test_a_following_step_reserves_pages_for_the_most_the_step_in_flight_accepts():
    """`follow` builds the next drafting step before the one in flight is read back: pages for 2 * width tokens
    past the known ones (that step's root may move up to width, and the next writes width - 1 past its own),
    the root at its upper bound, every draft scheduled. It declines, leaving pages and gate alone, where the
    next step must be scheduled from exact state."""
    width = 4  # a chain of 3 drafts
    alloc = PageAllocator(num_pages=40, page_size=4)
    sched = Scheduler(SchedulerConfig(max_running_requests=4, chunked_prefill_size=64), alloc, max_model_len=128,
                      draft_plan=lambda request: 3, max_draft_tokens=3)
    for rid, max_tokens in (("a", 40), ("b", 40)):
        sched.add(_request(rid, 10, max_tokens))
    for seq in sched.schedule().seqs:  # both prompts in one step
        request = sched.requests[seq.request_id]
        request.num_computed_tokens = request.num_draft_computed_tokens = 10
        request.token_ids.append(7)
    drafting = sched.schedule()
    assert [s.num_draft_tokens for s in drafting.seqs] == [3, 3]
    follow = sched.follow(drafting, width)
    assert follow.follow == [0, 1]
    for seq, request in zip(follow.seqs, sched.running):
        assert seq.start_pos == request.num_computed_tokens + width == 14 and seq.num_draft_tokens == 3
        assert len(request.page_ids) * alloc.page_size >= request.num_computed_tokens + 2 * width
    # A request that drafted nothing in the step in flight: its head would skip what it missed.
    held = StepBatch([drafting.seqs[0], replace(drafting.seqs[1], num_draft_tokens=0, draft_catchup_ids=[])], 4)
    assert sched.follow(held, width) is None
    # A request near its max_tokens, or a finished one that was the only row: from exact state.
    sched.requests["a"].max_tokens = sched.requests["a"].num_output_tokens + 2 * width
    assert sched.follow(drafting, width) is None
    sched.requests["a"].max_tokens = 40
    sched.finish(sched.requests["b"], FinishReason.STOP)
    assert sched.follow(drafting, width).follow == [0]  # b is gone: a continues its row
    # A prompt that could be admitted now makes the next step wait and schedule it.
    sched.add(_request("c", 6, 10))
    free = alloc.num_free
    assert sched.follow(drafting, width) is None and alloc.num_free == free
