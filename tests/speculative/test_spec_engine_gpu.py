"""Speculation on a GPU with CUDA graphs: a draft model and an EAGLE-3 head draft as they do eagerly, and the
adaptive plan stays lossless under overlap."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from specserve.config import SpecConfig
from specserve.engine.factory import build_engine_core

from engine_runs import hf_greedy, make_prompts, run_staggered, tight_config, watch_drafting_paths
from tiny_checkpoints import write_peaked_random_head

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("algorithm,topk", [("DRAFT_MODEL", 1), ("DRAFT_MODEL", 4)])
def test_speculation_with_graphs_matches_the_reference_fp32(tiny_checkpoint, algorithm, topk):
    path = tiny_checkpoint("llama", True)
    prompts = make_prompts(512, seed=6)
    reference = hf_greedy(path, prompts, "cuda")
    spec = SpecConfig(algorithm, str(path), 3, topk, 8 if topk > 1 else None)
    engine, _ = build_engine_core(replace(tight_config(str(path), 200), device="cuda", spec=spec), progress=False)
    rng = random.Random(0)
    engine.scheduler.draft_plan = lambda request: rng.choice([0, 0, 2, engine.scheduler.max_draft_tokens])
    ours, _ = run_staggered(engine, prompts)
    assert ours == reference
    assert engine.runner.graphs.num_replays > 0  # steps without drafts replayed graphs


def test_eagle3_taps_stored_by_graphed_steps_draft_like_eager_ones(tiny_checkpoint, tmp_path):
    """Steps that draft nothing replay graphs, which also store the EAGLE-3 head's taps; the drafts made
    from them later equal those of a run with graphs off (a peaked random head, fp32)."""
    path = tiny_checkpoint("llama", True)
    write_peaked_random_head(path, tmp_path)
    prompts = make_prompts(512, seed=8)
    runs = []
    for disable in (False, True):
        spec = SpecConfig("EAGLE3", str(tmp_path), 3, 2, 6)
        config = replace(tight_config(str(path), 200), device="cuda", spec=spec, disable_cuda_graph=disable)
        engine, _ = build_engine_core(config, progress=False)
        rng = random.Random(0)
        engine.scheduler.draft_plan = lambda request: rng.choice([0, 0, 0, 5])
        trees, propose = [], engine.runner.proposer.propose
        engine.runner.proposer.propose = lambda batch: trees.append(propose(batch)) or trees[-1]
        outputs, _ = run_staggered(engine, prompts)
        runs.append((outputs, [{i: (t.tokens, t.parents) for i, t in step.items()} for step in trees]))
        assert (engine.runner.graphs is None) == disable
    assert runs[0] == runs[1]
    assert runs[0][0] == hf_greedy(path, prompts, "cuda")


@pytest.mark.parametrize("topk,num_draft_tokens", [(1, None), (3, 9)])
def test_adaptive_plan_with_graphs_and_overlap_matches_transformers(tiny_checkpoint, tmp_path, topk,
                                                                    num_draft_tokens):
    """The adaptive plan on a GPU: the gate opens and shuts (step costs from a model that makes drafting pay
    for a while, then not), so steps alternate between overlapped plain graphs and chain or tree programs,
    and the first drafting step after a shut spell catches the head up on many tokens. Greedy output equals
    HF's, and every page is freed."""
    path = tiny_checkpoint("llama", True)
    write_peaked_random_head(path, tmp_path)
    prompts = make_prompts(512, seed=5)
    spec = SpecConfig("EAGLE3", str(tmp_path), 4, topk, num_draft_tokens, adaptive=True)
    engine, _ = build_engine_core(replace(tight_config(str(path), 1200), device="cuda", spec=spec), progress=False)
    assert engine.overlap
    observe, clock = engine.observer.observe_step, [0]

    def phased_costs(drafted, size, seconds):
        clock[0] += 1
        drafting_pays = (clock[0] // 10) % 2 == 0
        observe(drafted, size, (0.5 if drafting_pays else 5.0) if drafted else 1.0)

    engine.observer.observe_step = phased_costs
    engine.observer.config = replace(engine.observer.config, probe_every=8, max_probe_every=8)
    general, backlogs = watch_drafting_paths(engine)
    program = engine.runner.program
    plain_replays = engine.runner.graphs.num_replays
    outputs, _ = run_staggered(engine, prompts, max_tokens=40)
    assert outputs == hf_greedy(path, prompts, "cuda", max_tokens=40)
    assert program.num_runs > 3 and engine.runner.graphs.num_replays > plain_replays + 3
    assert backlogs and not any(general)  # every drafting step after a shut spell was still the program
    alloc = engine.scheduler.allocator
    assert alloc.num_free == alloc.num_pages
