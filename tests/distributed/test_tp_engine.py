"""Tensor parallelism on the CPU: two gloo ranks, the test process as rank 0. Greedy output with --tp-size 2
equals HF's (which --tp-size 1 is held to in tests/models), and speculation stays lossless."""
from __future__ import annotations

import functools
import random
from dataclasses import replace

import pytest

from specserve.config import ParallelConfig, SpecConfig
from specserve.core import SamplingParams
from specserve.distributed.ranks import NO_MULTICAST_ENV
from specserve.engine.factory import build_engine_core
from specserve.llm import LLM

from engine_runs import hf_greedy, make_prompts, run_mixed_sampling, run_staggered, tight_config
from tiny_checkpoints import write_peaked_random_head


@functools.cache
def hf_reference(path, seed: int = 0, max_tokens: int = 24) -> list[list[int]]:
    return hf_greedy(path, make_prompts(512, seed), max_tokens=max_tokens)


def tp_engine(config, size: int = 2):
    engine, _ = build_engine_core(replace(config, parallel=ParallelConfig(size)), progress=False)
    return engine


def closed(engine):
    """Stops the other ranks and leaves the process group, so the next test can form its own."""
    engine.runner.step_sender.close()


def _all_pages_back(engine) -> bool:
    alloc = engine.scheduler.allocator
    alloc.check_invariants()
    return alloc.num_free == alloc.num_pages


@pytest.mark.parametrize("kind", ["llama", "qwen3-moe", "deepseek-v3"])
def test_greedy_with_two_ranks_matches_transformers(kind, tiny_checkpoint):
    path = tiny_checkpoint(kind, True)
    prompts = make_prompts(512)
    engine = tp_engine(tight_config(str(path), max_total_tokens=160))
    try:
        ours, _ = run_staggered(engine, prompts, max_tokens=12)
    finally:
        closed(engine)
    assert ours == hf_reference(path, max_tokens=12)
    assert engine.runner.model.tp.size == 2  # each rank holds its shard
    assert engine.scheduler.num_preemptions > 0 and _all_pages_back(engine)


def test_every_rank_runs_with_nvlink_multicast_off(tiny_chat_model):
    """Through the offline API (`LLM(tp_size=2)`): the worker's environment has the multicast switches."""
    llm = LLM(model=str(tiny_chat_model), tp_size=2, max_total_tokens=256, page_size=8)
    try:
        out = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
        worker = llm.engine.runner.step_sender.group.workers[0]
        with open(f"/proc/{worker.pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    finally:
        closed(llm.engine)
    assert len(out.token_ids) == 4 and worker.returncode == 0
    assert {k: env.get(k.encode()) for k in NO_MULTICAST_ENV} == {k: v.encode() for k, v in NO_MULTICAST_ENV.items()}


SHAPES = {"chain": dict(num_steps=3), "tree": dict(num_steps=4, eagle_topk=3, num_draft_tokens=9)}


def _spec_engine(tmp_path, tiny_checkpoint, shape: str, **spec):
    path = tiny_checkpoint("llama", True)
    write_peaked_random_head(path, tmp_path)
    spec = SpecConfig("EAGLE3", str(tmp_path), **{**SHAPES[shape], **spec})
    return tp_engine(replace(tight_config(str(path), 200), spec=spec)), path


@pytest.mark.parametrize("shape,program,overlap,policy", [
    ("chain", True, False, None), ("chain", True, True, None), ("tree", True, True, None),
    ("tree", False, False, None), ("tree", True, True, "goodput"), ("tree", False, False, "goodput")])
def test_speculation_with_two_ranks_is_lossless(tmp_path, tiny_checkpoint, switches, shape, program, overlap,
                                                policy):
    """The chain and tree programs (overlapped: each drafting step follows the one in flight on the device), the
    general tree search, and the goodput policy choosing among chains and the tree per step (through the general
    search, pruning trees by their draft scores): HF's output, and every rank accepted what rank 0 accepted
    (their replicated head KV, taps and program state are identical)."""
    switches(tree_program_on_cpu=program)
    spec = dict(adaptive=True, policy=policy) if policy else {}
    engine, path = _spec_engine(tmp_path, tiny_checkpoint, shape, **spec)
    assert not policy or len(engine.runner.program.chains) > 1  # chains of several depths beside the tree
    engine.overlap = overlap
    prompts = make_prompts(512, seed=4)
    if policy:  # step times from a cost model, not the machine's clock: drafting pays, deeper shapes cost more
        plan, observe = engine.observer, engine.observer.observe_step
        engine.observer.observe_step = lambda drafted, size, seconds: observe(
            drafted, size, 1.0 + (0.01 * (plan.shape + 1) * size if drafted else 0.0))
    if policy and not program:  # every step drafts a tree, pruned at a floor drawn per request and step
        rng = random.Random(1)
        engine.scheduler.draft_gate = lambda requests: True
        engine.scheduler.draft_plan = lambda request: 8
        engine.scheduler.draft_prune = lambda request: rng.choice([0.0, 0.05, 0.3])
    floors = []  # the pruning floors sent to the other ranks
    send = engine.runner.step_sender.send
    engine.runner.step_sender.send = lambda batch, publish: (floors.extend(s.draft_min_prob for s in batch.seqs),
                                                             send(batch, publish))
    try:
        outputs, _ = run_staggered(engine, prompts)
        agree = engine.runner.step_sender.replicas_agree(engine.runner)
    finally:
        closed(engine)
    assert (engine.runner.program is not None and engine.runner.program.num_runs > 10) == program
    assert max(floors) > 0 or program or not policy  # the floors drawn above reached the other ranks
    assert outputs == hf_reference(path, seed=4)
    assert agree and engine.scheduler.num_preemptions > 0 and _all_pages_back(engine)


def test_sampled_rows_and_the_adaptive_plan_agree_on_every_rank(tmp_path, tiny_checkpoint):
    """Greedy, top-k 1 and fully sampled requests in one batch, with the adaptive plan deciding when to draft:
    every rank draws the same tokens (their replicated state agrees), and the greedy rows are HF's."""
    engine, path = _spec_engine(tmp_path, tiny_checkpoint, "chain", adaptive=True)
    prompts = make_prompts(512, seed=4)[:6]
    try:
        outputs = run_mixed_sampling(engine, prompts)
        agree = engine.runner.step_sender.replicas_agree(engine.runner)
    finally:
        closed(engine)
    reference = hf_reference(path, seed=4)
    assert agree and [out == ref for out, ref in zip(outputs, reference)][:2] == [True, True]


def test_a_replicated_draft_model_with_two_ranks_is_lossless(tiny_checkpoint):
    """A draft model (whole on every rank, unsharded) drafting trees for the sharded target."""
    path = tiny_checkpoint("llama", True)
    spec = SpecConfig("DRAFT_MODEL", str(path), 3, 2, 6)
    engine = tp_engine(replace(tight_config(str(path), 200), spec=spec))
    try:
        outputs, _ = run_staggered(engine, make_prompts(512, seed=4))
        agree = engine.runner.step_sender.replicas_agree(engine.runner)
    finally:
        closed(engine)
    assert agree and outputs == hf_reference(path, seed=4)


def test_penalties_bias_seeds_and_logprobs_reach_every_rank(tmp_path, tiny_checkpoint):
    """Requests whose settings the general path applies (penalties over their tokens, logit_bias, a seed,
    logprobs), the target drafting for itself (its drafts are its raw argmax, which the adjusted logits reject
    at times): every rank verifies with the same adjusted logits, so the ranks agree, and the output equals one
    rank's."""
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, repetition_penalty=1.5,
                             presence_penalty=0.5, logit_bias={7: 5.0}),
              SamplingParams(max_tokens=16, temperature=0.9, seed=11, ignore_eos=True, frequency_penalty=0.3),
              SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=2)]
    prompts = make_prompts(512, seed=6)[:3]
    runs = []
    for size in (1, 2):
        path = tiny_checkpoint("llama", True)
        config = replace(tight_config(str(path), 200), spec=SpecConfig("DRAFT_MODEL", str(path), 3, 2, 6),
                         parallel=ParallelConfig(size))
        engine, _ = build_engine_core(config, progress=False)
        outputs = {str(i): [] for i in range(3)}
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                engine.add_request(str(i), prompt, p)
            while engine.has_work():
                for delta in engine.step():
                    outputs[delta.request_id] += delta.new_token_ids
            runs.append(list(outputs.values()))
            assert size == 1 or engine.runner.step_sender.replicas_agree(engine.runner)
        finally:
            if size == 2:
                closed(engine)
    assert runs[0] == runs[1] and all(len(out) == 16 for out in runs[1])


def test_page_table_changes_keep_two_ranks_on_hf_through_preemption_and_aborts(tiny_checkpoint):
    """Step descriptions carry page-table changes only: with requests preempted, and others aborted mid-run
    (their tables dropped on every rank, their pages handed to others), the requests left still produce HF's
    output, and every step's checksum held (a worker whose tables differed would have stopped the engine)."""
    path = tiny_checkpoint("llama", True)
    prompts = make_prompts(512)
    engine = tp_engine(tight_config(str(path), max_total_tokens=112))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    aborts = {5: ["1"], 9: ["4", "6"]}  # step -> requests aborted before it, each mid-prompt or mid-output
    outputs = {str(i): [] for i in range(len(prompts))}
    sender, seen = engine.runner.step_sender, set()
    send = sender.send
    sender.send = lambda batch, publish: seen.update(s.request_id for s in batch.seqs) or send(batch, publish)
    try:
        step = 0
        while step <= 12 or engine.has_work():
            for i, arrival in enumerate([0, 0, 1, 3, 3, 6, 7, 11]):
                if arrival == step:
                    engine.add_request(str(i), prompts[i], params)
            engine.abort(aborts.get(step, []))
            for delta in engine.step():
                outputs[delta.request_id] += delta.new_token_ids
            step += 1
        alive = sender.group.workers[0].poll() is None
    finally:
        closed(engine)
    reference = hf_reference(path, max_tokens=12)
    kept = [i for i in range(len(prompts)) if str(i) not in {"1", "4", "6"}]
    assert alive and [outputs[str(i)] for i in kept] == [reference[i] for i in kept]
    assert all(len(outputs[rid]) < 12 for rid in ("1", "4", "6"))
    # A preempted request, readmitted, joined the steps anew: its table was dropped, then sent whole.
    assert engine.scheduler.num_preemptions > 0 and sender.encoder.next_key > len(seen)
    assert _all_pages_back(engine)
