"""Prefix caching's bookkeeping, without a model: shared pages are freed exactly once after their last user,
idle cached pages are evicted least recently used first and never while in use, hits leave the last token to
compute, pages wait for the drafter, and no step ever writes into an indexed page. Pure Python."""
from __future__ import annotations

import random

import pytest

from specserve.config import SchedulerConfig
from specserve.core import FinishReason, Request, SamplingParams
from specserve.engine.scheduler import Scheduler
from specserve.kv.pages import OutOfPages, PageAllocator
from specserve.kv.prefix import ROOT, PrefixCache


def _indexed(page_size: int, num_pages: int) -> tuple[PageAllocator, PrefixCache]:
    alloc = PageAllocator(num_pages, page_size)
    return alloc, PrefixCache(alloc)


def test_a_shared_page_is_freed_once_after_its_last_user():
    alloc, cache = _indexed(page_size=2, num_pages=4)
    a = alloc.allocate("a", 2)
    assert cache.insert(ROOT, [1, 2, 3], a[0]) == a[0] and cache.insert(a[0], [3, 4, 5], a[1]) == a[1]
    assert cache.match([1, 2, 3, 4, 5, 6]) == a
    assert cache.match([1, 2, 3, 4]) == a[:1]  # the token after the second page is unknown: not served
    assert cache.match([1, 2, 3, 4, 6]) == a[:1]  # the next token differs: the head's KV there would be stale
    alloc.share("b", a)
    with pytest.raises(RuntimeError):
        alloc.share("b", a)  # one owner holds a page once
    alloc.free("a", a)
    assert alloc.num_used == 2 and alloc.users(a[0]) == {"b"}
    alloc.check_invariants()
    alloc.free("b", a)
    assert alloc.num_used == 0 and alloc.num_free == 4 and alloc.num_cached == 2  # idle, still indexed
    with pytest.raises(RuntimeError):
        alloc.free("b", a)  # a second release is a bug, caught loudly
    alloc.check_invariants()
    cache.check_invariants()


def test_idle_pages_are_evicted_least_recent_first_and_never_in_use():
    alloc, cache = _indexed(page_size=2, num_pages=5)
    a, b = alloc.allocate("a", 2), alloc.allocate("b", 2)
    cache.insert(ROOT, [1, 1, 1], a[0])
    cache.insert(a[0], [1, 1, 1], a[1])
    cache.insert(ROOT, [2, 2, 2], b[0])
    alloc.free("a", a)  # released tail first: a[1] is the least recent
    cache.check_invariants()
    assert alloc.allocate("c", 1) == [alloc.num_pages - 1]  # a free page comes before any eviction
    c = alloc.allocate("c", 1)
    assert c == [a[1]] and cache.match([1, 1, 1, 1, 1, 1]) == [a[0]]
    d = alloc.allocate("d", 1)
    assert d == [a[0]] and cache.match([1, 1, 1, 1, 1, 1]) == []
    with pytest.raises(OutOfPages):
        alloc.allocate("e", 1)  # b's page is cached but in use: never evicted
    assert cache.match([2, 2, 2, 2]) == [b[0]]
    alloc.check_invariants()
    cache.check_invariants()


def test_evicting_a_page_drops_the_pages_that_hang_on_it():
    alloc, cache = _indexed(page_size=1, num_pages=3)
    pages = alloc.allocate("a", 3)
    for parent, page in zip([ROOT] + pages, pages):
        cache.insert(parent, [7, 7], page)
    alloc.free("a", pages[:1])
    alloc.free("a", pages[1:])  # the head went idle first: it is the least recent
    assert alloc.allocate("b", 1) == [pages[0]]
    assert len(cache) == 0 and alloc.num_free == 2  # its children could no longer be reached
    alloc.check_invariants()
    cache.check_invariants()


def _scheduler(num_pages: int, page_size: int = 4, drafting: bool = False, rng=None, budget: int = 32,
               max_model_len: int = 256) -> Scheduler:
    alloc = PageAllocator(num_pages, page_size)
    plan = (lambda request: rng.choice([0, 1, 3])) if drafting else None
    return Scheduler(SchedulerConfig(max_running_requests=6, chunked_prefill_size=budget), alloc, max_model_len,
                     draft_plan=plan, max_draft_tokens=3, prefix_cache=PrefixCache(alloc),
                     draft_lead=1 if drafting else 0)


def _run_step(sched: Scheduler, rng: random.Random, vocab: int = 4) -> None:
    """Pretends to run one step: checks that the target writes into no indexed page and the drafter into none
    it counts as drafted (it may fill an indexed page's draft KV that a request computed while its drafter
    stayed behind), then advances the counters as the engine does (random acceptance, random tokens from a small
    vocabulary)."""
    batch = sched.schedule()
    alloc, size = sched.allocator, sched.allocator.page_size
    alloc.check_invariants()
    sched.prefix_cache.check_invariants()
    indexed = alloc.cached_pages
    for seq in batch.seqs:
        assert not set(seq.page_ids[seq.start_pos // size:]) & indexed, "the target writes into an indexed page"
        if seq.draft_catchup_ids:  # an EAGLE-3 head writes from the position before its first new token
            first_draft_page = max(seq.draft_start_pos - sched.draft_lead, 0) // size
            assert first_draft_page >= sched.requests[seq.request_id].num_drafted_pages, \
                "the drafter writes into a page it counts as drafted"
        assert len(seq.page_ids) * size >= seq.start_pos + len(seq.token_ids) + seq.num_draft_tokens
    for seq in batch.seqs:
        request = sched.requests[seq.request_id]
        request.num_computed_tokens += len(seq.token_ids)
        if seq.draft_catchup_ids:
            request.num_draft_computed_tokens = seq.draft_start_pos + len(seq.draft_catchup_ids)
        if not seq.sample:
            continue
        accepted = rng.randint(0, seq.num_draft_tokens)
        request.num_computed_tokens += accepted
        for _ in range(accepted + 1):
            request.token_ids.append(rng.randrange(vocab))
            if request.num_output_tokens >= request.max_tokens:
                sched.finish(request, FinishReason.LENGTH)
                break
        if not request.finished:
            sched.trim(request)


def test_a_hit_shares_full_pages_and_leaves_the_last_token_to_compute():
    rng = random.Random(0)
    sched = _scheduler(num_pages=32, drafting=True, rng=rng)
    prompt = list(range(10, 30))  # five full pages of four
    sched.add(Request("a", prompt, SamplingParams(max_tokens=4), 4))
    while sched.has_work():
        _run_step(sched, rng)
    sched.add(Request("b", prompt, SamplingParams(max_tokens=4), 4))
    batch = sched.schedule()
    b = sched.requests["b"]
    # Page 4's key needs token 20, which the prompt does not have: four pages served, four tokens computed.
    assert b.num_cached_tokens == 16 and batch.seqs[0].start_pos == 16 and batch.seqs[0].token_ids == prompt[16:]
    assert b.num_draft_computed_tokens == 17  # the head's KV over the cached pages is valid: it saw token 16
    assert sched.prefix_cache.hit_tokens == 16


def test_pages_computed_while_the_drafter_stayed_behind_are_served_without_draft_kv():
    """Drafting does not pay, so the head stays behind over the prompt: its pages are indexed all the same,
    marked drafted only as the head catches up, and a hit serves draft KV over the drafted ones alone."""
    sched = _scheduler(num_pages=32, drafting=True, rng=random.Random(0))
    sched.draft_plan = lambda request: 0
    sched.follow_gate = lambda requests: False
    prompt = list(range(1, 21))
    sched.add(Request("a", prompt, SamplingParams(max_tokens=8), 8))
    batch = sched.schedule()
    a = sched.requests["a"]
    assert not batch.seqs[0].draft_catchup_ids
    a.num_computed_tokens = 20
    a.token_ids.append(5)
    sched.schedule()
    cache = sched.prefix_cache
    assert a.num_draft_computed_tokens == 0 and len(cache) == 4 and a.num_drafted_pages == 0
    sched.add(Request("b", prompt + [9], SamplingParams(max_tokens=8), 8))
    sched.schedule()
    b = sched.requests["b"]
    assert b.num_cached_tokens == 16 and b.num_draft_computed_tokens == 1  # the head starts from the beginning
    a.num_draft_computed_tokens = 9  # caught up over tokens 0..8: the head's KV is valid up to position 7
    sched.schedule()
    assert a.num_drafted_pages == 2 and cache.drafted_prefix(a.page_ids) == 2
    sched.add(Request("c", prompt + [7], SamplingParams(max_tokens=8), 8))
    sched.schedule()
    c = sched.requests["c"]
    assert c.num_cached_tokens == 16 and c.num_draft_computed_tokens == 9 and c.num_drafted_pages == 2
    cache.check_invariants()


@pytest.mark.parametrize("drafting", [False, True])
def test_a_thousand_random_requests_with_shared_prefixes_leave_no_page_in_use(drafting):
    """Submit, abort mid-run, disconnect before admission, preemption and eviction, over a pool too small for
    the load; every step checks the allocator's and the index's invariants and that no write lands in an
    indexed page."""
    rng = random.Random(1 if drafting else 2)
    sched = _scheduler(num_pages=40, drafting=drafting, rng=rng)
    systems = [[rng.randrange(4) for _ in range(rng.randint(3, 30))] for _ in range(6)]
    submitted = 0
    while submitted < 1000 or sched.has_work():
        if submitted < 1000 and rng.random() < 0.5:
            prompt = rng.choice(systems) + [rng.randrange(4) for _ in range(rng.randint(1, 12))]
            max_tokens = rng.randint(1, 24)
            sched.add(Request(f"r{submitted}", prompt, SamplingParams(max_tokens=max_tokens), max_tokens))
            submitted += 1
        if sched.requests and rng.random() < 0.1:
            fate = rng.random()
            victims = list(sched.waiting) if fate < 0.5 else sched.running  # disconnect early, or abort
            if victims:
                sched.abort(rng.choice(victims).request_id)
        _run_step(sched, rng)
    alloc = sched.allocator
    assert alloc.num_used == 0 and alloc.num_free == alloc.num_pages
    assert sched.num_preemptions > 0 and alloc.num_evicted > 0 and sched.prefix_cache.hit_tokens > 0
    alloc.check_invariants()
    sched.prefix_cache.check_invariants()
