"""Prompts, configs and engine runs that tests of every subsystem share: staggered arrivals, mixed sampling,
HF's greedy output to compare with, and wrappers that record what the engine's steps did."""
from __future__ import annotations

import random

import torch

from specserve.config import CacheConfig, EngineConfig, SchedulerConfig
from specserve.core import SamplingParams
from specserve.engine.factory import build_engine_core

PROMPT_LENS = [3, 17, 40, 9, 64, 25, 1, 33]
ARRIVAL_STEPS = [0, 0, 1, 3, 3, 6, 10, 11]
MAX_TOKENS = 24


def make_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]


def hf_greedy(model_dir, prompts: list[list[int]], device: str = "cpu",
              max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    outs = []
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt], device=device), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device))
        outs.append(ids[0, len(prompt):].tolist())
    return outs


def engine_greedy(config: EngineConfig, prompts: list[list[int]]):
    engine, _ = build_engine_core(config, progress=False)
    outputs, _ = run_staggered(engine, prompts)
    return outputs, engine


def run_staggered(engine, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> tuple[list[list[int]], int]:
    """Feeds prompt i at step ARRIVAL_STEPS[i]; returns the greedy outputs and the number of engine steps."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    step = 0
    while step <= max(ARRIVAL_STEPS) or engine.has_work():
        for i, arrival in enumerate(ARRIVAL_STEPS):
            if arrival == step:
                engine.add_request(str(i), prompts[i], params)
        for delta in engine.step():
            outputs[delta.request_id] += delta.new_token_ids
        step += 1
    return [outputs[str(i)] for i in range(len(prompts))], step


def tight_config(model_path: str | None, max_total_tokens: int) -> EngineConfig:
    return EngineConfig(
        model_path=model_path,
        dtype="float32",
        device="cpu",
        cache=CacheConfig(page_size=8, max_total_tokens=max_total_tokens),
        scheduler=SchedulerConfig(max_running_requests=6, chunked_prefill_size=32),
    )


def check_matches_hf(config: EngineConfig, model_dir, vocab: int, device: str = "cpu") -> None:
    prompts = make_prompts(vocab)
    ours, engine = engine_greedy(config, prompts)
    theirs = hf_greedy(model_dir, prompts, device)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a == b, (f"prompt {i} (len {PROMPT_LENS[i]}) diverged at token "
                        f"{next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)}")
    assert engine.scheduler.num_preemptions > 0, "the pool is meant to be small enough to force preemption"
    alloc = engine.scheduler.allocator
    assert alloc.num_free == alloc.num_pages
    alloc.check_invariants()


def count_accepted(engine) -> list[int]:
    """Wraps engine.step to collect every speculative step's accepted-draft counts (the returned list)."""
    accepted, step = [], engine.step

    def counted():
        deltas = step()
        accepted.extend(d.step_accepted for d in deltas if d.step_accepted is not None)
        return deltas
    engine.step = counted
    return accepted


def watch_drafting_paths(engine) -> tuple[list[bool], list]:
    """Wraps the engine's general draft search and its step program's backlog pass. The first list gets, per
    call of the search, whether it drafted (rather than only extended the drafter); the second, each batch
    whose backlog the pass caught up on."""
    proposer, program, general, backlogs = engine.runner.proposer, engine.runner.program, [], []
    propose, catch_up_backlog = proposer.propose, program.catch_up_backlog
    proposer.propose = lambda batch: general.append(any(s.num_draft_tokens for s in batch.seqs)) or propose(batch)
    program.catch_up_backlog = lambda batch: backlogs.append(batch) or catch_up_backlog(batch)
    return general, backlogs


def run_mixed_sampling(engine, prompts: list[list[int]], max_tokens: int = 24) -> list[list[int]]:
    """Requests in turn greedy, sampled with top-k 1 (greedy in effect) and sampled in full, none seeded, all
    added at once; returns their outputs in order."""
    kinds = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=max_tokens, temperature=1.0, top_k=1, ignore_eos=True),
             SamplingParams(max_tokens=max_tokens, temperature=1.5, ignore_eos=True)]
    outputs = {str(i): [] for i in range(len(prompts))}
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, kinds[i % 3])
    while engine.has_work():
        for delta in engine.step():
            outputs[delta.request_id] += delta.new_token_ids
    return [outputs[str(i)] for i in range(len(prompts))]


def run_batch(llm, prompts, params) -> tuple[list, int]:
    """Runs requests through the offline API together: their outputs, and the engine steps they took."""
    trackers = [llm.add(p, q) for p, q in zip(prompts, params)]
    steps = 0
    while llm.engine.has_work():
        llm.step_and_track(trackers)
        steps += 1
    return [t.output for t in trackers], steps
