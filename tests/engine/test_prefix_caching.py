"""Prefix caching through the whole engine: greedy output with cache hits equals output without caching, for
plain decoding, EAGLE-3 chains (the chain program) and trees (the general search and the tree program) and a
draft model; no step writes into a shared page (its target KV, draft KV and taps are unchanged after other
requests ran over it); eviction under memory pressure; and, with the bundled SmolLM2 head, the same acceptance
on a second pass."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from specserve.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from specserve.core import SamplingParams
from specserve.engine.factory import build_engine_core

PAGE = 8


def _conversations(vocab: int, seed: int = 0) -> tuple[list[int], list[list[int]], list[list[int]]]:
    """A shared system prompt, each user's first message, and the second message of each."""
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(3, vocab) for _ in range(n)]  # noqa: E731
    return words(21), [words(n) for n in (5, 13, 2, 30)], [words(n) for n in (7, 1, 16, 4)]


def _run(engine, prompts: list[list[int]], turn: int, max_tokens: int = 12) -> tuple[list[list[int]], list[int]]:
    """Greedy outputs, and the prompt tokens each request was served from the cache."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    order = [f"turn{turn}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(order, prompts):
        engine.add_request(rid, prompt, params)
    outputs: dict[str, list[int]] = {rid: [] for rid in order}
    cached = dict.fromkeys(order, 0)
    while engine.has_work():
        for delta in engine.step():
            outputs[delta.request_id].extend(delta.new_token_ids)
            cached[delta.request_id] = delta.num_cached_tokens
    return [outputs[rid] for rid in order], [cached[rid] for rid in order]


def _two_turns(engine, vocab: int):
    """Turn one for every conversation, then turn two (history, answer, next message); returns both turns'
    outputs, the turn-one prompts, the tokens turn two was served from the cache, and a snapshot of the pages
    indexed after turn one."""
    system, first, second = _conversations(vocab)
    turn1 = [system + user for user in first]
    answers, _ = _run(engine, turn1, 1)
    snapshot = _snapshot(engine)
    turn2 = [p + a + nxt for p, a, nxt in zip(turn1, answers, second)]
    replies, cached = _run(engine, turn2, 2)
    return (answers, replies), turn1, cached, snapshot


def _snapshot(engine) -> dict:
    """Per indexed page: its target KV, and the drafter's KV and taps where there are any."""
    pages = sorted(engine.scheduler.allocator.cached_pages)
    drafter = engine.runner.proposer.drafter if engine.runner.proposer is not None else None
    tensors = [engine.runner.kv_cache]
    if drafter is not None:
        tensors.append(drafter.kv_cache)
    taps = getattr(drafter, "taps", None)
    snap = {}
    for page in pages:
        slots = torch.arange(page * PAGE, (page + 1) * PAGE)
        snap[page] = [t[:, :, slots].clone() for t in tensors] + ([taps[slots].clone()] if taps is not None else [])
    return snap


def _config(target, spec: SpecConfig, caching: bool, max_total_tokens: int = 1024) -> EngineConfig:
    return EngineConfig(model_path=str(target), dtype="float32", device="cpu", spec=spec,
                        cache=CacheConfig(page_size=PAGE, max_total_tokens=max_total_tokens,
                                          enable_prefix_caching=caching),
                        scheduler=SchedulerConfig(max_running_requests=6, chunked_prefill_size=32))


@pytest.mark.parametrize("kind", ["plain", "eagle3-chain", "eagle3-tree", "eagle3-tree-program", "draft-model"])
def test_greedy_with_cache_hits_equals_greedy_without(tiny_checkpoint, random_eagle3_head, switches, kind):
    target = tiny_checkpoint("llama", True)
    if kind == "eagle3-tree-program":  # the tree program, as on a GPU: nodes verified in scratch slots, then moved
        switches(tree_program_on_cpu=True)
    spec = {"plain": SpecConfig(),
            "eagle3-chain": SpecConfig("EAGLE3", str(random_eagle3_head), 3, 1),
            "eagle3-tree": SpecConfig("EAGLE3", str(random_eagle3_head), 3, 2, 6),
            "eagle3-tree-program": SpecConfig("EAGLE3", str(random_eagle3_head), 3, 2, 6),
            "draft-model": SpecConfig("DRAFT_MODEL", str(target), 3, 1)}[kind]
    off, _ = build_engine_core(_config(target, spec, caching=False), progress=False)
    on, _ = build_engine_core(_config(target, spec, caching=True), progress=False)
    expected = _two_turns(off, 512)[0]
    outputs, turn1, cached, snapshot = _two_turns(on, 512)
    assert outputs == expected
    cache = on.scheduler.prefix_cache
    # Turn two finds its whole first turn, all but the last page at most (its answer's pages too, mostly).
    assert all(hit >= len(p) // PAGE * PAGE for hit, p in zip(cached, turn1)), (cached, [len(p) for p in turn1])
    assert snapshot
    # Nothing was written into a page while it was indexed: other requests ran over these pages since.
    after = _snapshot(on)
    for page, tensors in snapshot.items():
        assert page in after, "evicted although the pool never ran short"
        assert all(torch.equal(a, b) for a, b in zip(tensors, after[page])), f"page {page} was written"
    alloc = on.scheduler.allocator
    assert alloc.num_used == 0 and alloc.num_free == alloc.num_pages
    alloc.check_invariants()
    cache.check_invariants()
    if kind == "plain":
        _check_metrics(on)


@pytest.mark.parametrize("kind", ["eagle3-chain", "eagle3-tree-program", "draft-model"])
def test_pages_computed_while_drafting_paused_serve_a_drafting_turn(tiny_checkpoint, random_eagle3_head, switches,
                                                                     kind):
    """Turn one with drafting paused (the adaptive plan's gate shut, so the drafter stays behind), turn two
    drafting every step: turn two is served turn one's pages all the same, the drafter catches up over them,
    greedy output equals that without caching, and a draft model's acceptance per step holds."""
    target = tiny_checkpoint("llama", True)
    if kind == "eagle3-tree-program":
        switches(tree_program_on_cpu=True)
    spec = {"eagle3-chain": SpecConfig("EAGLE3", str(random_eagle3_head), 3, 1),
            "eagle3-tree-program": SpecConfig("EAGLE3", str(random_eagle3_head), 3, 2, 6),
            "draft-model": SpecConfig("DRAFT_MODEL", str(target), 3, 1)}[kind]
    runs = []
    for caching in (False, True):
        engine, _ = build_engine_core(_config(target, spec, caching), progress=False)
        system, first, second = _conversations(512)
        turn1 = [system + user for user in first]
        engine.scheduler.draft_gate = engine.scheduler.follow_gate = lambda requests: False
        answers, _ = _run(engine, turn1, 1)
        cached_pages = engine.scheduler.allocator.cached_pages
        assert bool(cached_pages) == caching  # indexed, though the drafter computed none of them
        assert not any(engine.scheduler.prefix_cache.is_drafted(page) for page in cached_pages)
        engine.scheduler.draft_gate = engine.scheduler.follow_gate = lambda requests: True
        accepted = []
        step = engine.step
        engine.step = lambda: [d for d in step() if d.step_accepted is None or accepted.append(d.step_accepted)
                               or True]
        replies, cached = _run(engine, [p + a + n for p, a, n in zip(turn1, answers, second)], 2)
        runs.append((answers, replies, sum(accepted), len(accepted)))
        engine.scheduler.allocator.check_invariants()
    (plain, cached_run) = runs
    assert cached_run[:2] == plain[:2] and cached_run[3] > 5  # the same greedy output, drafting
    if kind == "draft-model":  # the target drafting for itself: draft KV caught up wrong would show here
        assert cached_run[2] / cached_run[3] >= 0.9 * plain[2] / plain[3]
    assert all(hit >= len(p) // PAGE * PAGE for hit, p in zip(cached, turn1))


def _check_metrics(engine) -> None:
    from specserve.server.metrics import Metrics

    stats = engine.stats()
    assert 0 < stats.prefix_hit_tokens < stats.prefix_queried_tokens and stats.prefix_cached_pages > 0
    metrics = Metrics()
    metrics.on_stats(stats)
    text = metrics.render().decode()
    rate = stats.prefix_hit_tokens / stats.prefix_queried_tokens
    assert f"specserve_prefix_cache_hit_rate {rate}" in text
    assert f"specserve_prefix_cache_hits_tokens {float(stats.prefix_hit_tokens)}" in text


def test_eviction_under_memory_pressure_keeps_greedy_output(tiny_checkpoint, random_eagle3_head):
    """A pool of 14 pages for four conversations: pages are evicted and requests preempted, and recomputing a
    preempted request hits what is left of its own pages."""
    target = tiny_checkpoint("llama", True)
    spec = SpecConfig("EAGLE3", str(random_eagle3_head), 3, 1)
    off, _ = build_engine_core(_config(target, spec, caching=False, max_total_tokens=112), progress=False)
    on, _ = build_engine_core(_config(target, spec, caching=True, max_total_tokens=112), progress=False)
    assert _two_turns(on, 512)[0] == _two_turns(off, 512)[0]
    alloc = on.scheduler.allocator
    assert alloc.num_evicted > 0 and on.scheduler.num_preemptions > 0 and on.scheduler.prefix_cache.hit_tokens > 0
    assert alloc.num_used == 0
    alloc.check_invariants()


def test_aborts_and_disconnects_leave_no_page_in_use(tiny_checkpoint, random_eagle3_head):
    target = tiny_checkpoint("llama", True)
    engine, _ = build_engine_core(_config(target, SpecConfig("EAGLE3", str(random_eagle3_head), 3, 1), True, 200),
                                  progress=False)
    rng = random.Random(0)
    system = [rng.randrange(3, 512) for _ in range(19)]
    added = 0
    while added < 40 or engine.has_work():
        if added < 40 and rng.random() < 0.4:
            prompt = system[:rng.randint(0, 19)] + [rng.randrange(3, 512) for _ in range(rng.randint(1, 9))]
            engine.add_request(f"r{added}", prompt, SamplingParams(max_tokens=rng.randint(1, 16), temperature=0.0))
            added += 1
        if engine.scheduler.requests and rng.random() < 0.15:
            engine.abort([rng.choice(list(engine.scheduler.requests))])
        if engine.has_work():
            engine.step()
        engine.scheduler.allocator.check_invariants()
    alloc = engine.scheduler.allocator
    assert alloc.num_used == 0 and engine.scheduler.prefix_cache.hit_tokens > 0
    engine.scheduler.prefix_cache.check_invariants()


def test_the_bundled_head_accepts_as_much_on_a_second_pass(smollm2_dir):
    """Greedy: the second pass over the same prompts hits the cache for all but each prompt's last page, and
    emits the same text with exactly the same acceptance."""
    from specserve import draft_heads
    from specserve.llm import LLM

    llm = LLM(model=str(smollm2_dir), max_total_tokens=2048,
              spec=SpecConfig("EAGLE3", str(draft_heads.SMOLLM2_HEAD), 3, 1))
    prompts = [llm.chat_prompt([{"role": "user", "content": "Write a short poem about the sea."}])]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    first = llm.generate(prompts, params)
    second = llm.generate(prompts, params)
    assert [o.num_cached_tokens for o in first] == [0]
    assert all(o.num_cached_tokens >= len(p) - 16 for o, p in zip(second, prompts))
    assert [o.token_ids for o in second] == [o.token_ids for o in first]
    assert [(o.num_spec_steps, o.num_accepted_tokens) for o in second] == \
        [(o.num_spec_steps, o.num_accepted_tokens) for o in first]
    assert sum(o.num_accepted_tokens for o in first) > 0
