"""Draft shapes chosen step to step: SGLang's tiers (the baseline policy) and the programs of every chain depth
a policy may pick. Greedy output equals plain greedy whatever shapes ran, shape changes mid-request included."""
from __future__ import annotations

import random
from dataclasses import replace

import pytest

from specserve.config import SpecConfig
from specserve.core import Request, SamplingParams
from specserve.engine.factory import build_engine_core
from specserve.speculative.plan import AdaptivePlan
from specserve.speculative.programs.shapes import ShapePrograms
from specserve.speculative.tiers import SglangTiers

from engine_runs import make_prompts, run_staggered, tight_config
from plan_drives import drive_plan
from tiny_checkpoints import write_peaked_random_head


def _requests(n: int) -> list[Request]:
    return [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=100), 100) for i in range(n)]


def test_tiers_follow_the_batch_size_and_the_acceptance_ema():
    tiers = SglangTiers(depth=7, full_drafts=7)
    assert [tiers.candidates(b) for b in (1, 7, 8, 31, 32, 63, 64, 250)] == [
        (1, 3, 5, 7), (1, 3, 5, 7), (0, 1, 3), (0, 1, 3), (0, 1), (0, 1), (0,), (0,)]
    assert tiers.step_drafts(_requests(1)) and tiers.drafts == 7  # a fresh server drafts deep
    assert not tiers.step_drafts(_requests(64))
    request = _requests(1)[0]
    tiers.step_drafts([request])
    rates = []
    for _ in range(4):  # nothing accepted: the EMA falls by a fifth each time
        tiers.observe_acceptance(request, tiers.drafts, 0)
        rates.append(tiers.accept_rate)
    assert rates == pytest.approx([0.8, 0.64, 0.512, 0.4096])
    assert tiers.steps_for(1) == 3 and tiers.steps_for(8) == 1 and tiers.steps_for(32) == 0
    tiers.observe_acceptance(request, 2, 0)  # fewer drafts than the step's shape: cut by the room left
    assert tiers.accept_rate == pytest.approx(0.4096)


def test_tiers_cap_steps_at_the_configured_depth_and_take_the_tree_there():
    chain = SglangTiers(depth=3, full_drafts=3)
    assert chain.candidates(1) == (1, 3) and chain.candidates(8) == (0, 1, 3)
    tree = SglangTiers(depth=3, full_drafts=8)  # top-2, 3 steps, 8 drafts
    assert tree.shape_drafts(3) == 8 and tree.shape_drafts(1) == 1
    assert SpecConfig("EAGLE3", None, 3, 2, 9, adaptive=True, policy="sglang-tiers").chain_lengths == (1,)
    assert SpecConfig("EAGLE3", None, 5, 1, adaptive=True, policy="sglang-tiers").chain_lengths == (1, 3, 5)
    assert SpecConfig("EAGLE3", None, 3, 2, 9, adaptive=True, policy="goodput").chain_lengths == (1, 2, 3)
    assert SpecConfig("EAGLE3", None, 3, 2, 9, adaptive=True).chain_lengths == ()
    assert SpecConfig("EAGLE3", None, 3).chain_lengths == (3,)


def _watch_depths(program: ShapePrograms) -> list[int]:
    """Wraps the programs' launch: each step's deepest row."""
    depths, launch = [], program.launch
    program.launch = lambda batch, timer: depths.append(max(s.num_draft_tokens for s in batch.seqs)) or launch(
        batch, timer)
    return depths


@pytest.mark.parametrize("topk", [1, 2])
def test_sglang_tiers_are_lossless_across_shape_changes(tmp_path, tiny_checkpoint, topk):
    """A random head's drafts fail, so the EMA falls and the tiers move from the configured shape to a chain
    of one draft while requests run; staggered arrivals move the batch across tiers too. On a tree server the
    tree steps take the general search, the chain steps the chain program."""
    path = tiny_checkpoint("llama", True)
    write_peaked_random_head(path, tmp_path)
    config = tight_config(str(path), 400)
    prompts = make_prompts(512, seed=6)
    plain, _ = build_engine_core(config, progress=False)
    expected, _ = run_staggered(plain, prompts)
    spec = SpecConfig("EAGLE3", str(tmp_path), 3, topk, 7 if topk > 1 else None, adaptive=True,
                      policy="sglang-tiers")
    engine, _ = build_engine_core(replace(config, spec=spec), progress=False)
    program = engine.runner.program
    depths = _watch_depths(program) if topk == 1 else []
    drafted = []
    step = engine.step
    engine.step = lambda: [d for d in step() if drafted.append(d.step_drafted) or True]
    outputs, _ = run_staggered(engine, prompts)
    assert outputs == expected
    assert engine.scheduler.allocator.num_used == 0
    if topk == 1:
        assert {1, 3} <= set(depths), depths
    else:
        assert program.k == 1 and program.num_runs > 0  # one chain depth (1 < 3 steps): no wrapper
        assert 1 in drafted and 6 in drafted, sorted(set(drafted))


# -- the goodput plan's shape choice, on a cost model with a fake clock ---------------------------------------
PLAIN = lambda b: 10.0 + 0.02 * b  # noqa: E731
CHAIN = lambda b, d: 11.0 + 0.02 * b + 0.03 * b * (d + 1)  # noqa: E731  (verified rows cost at load)


def _drive_shapes(plan: AdaptivePlan, requests, accept, steps: int = 3000, seed: int = 0):
    """accept(request, j): the chance that draft position j is accepted when all before it were. A step costs
    CHAIN at its deepest row."""
    cost = lambda batch, deepest: CHAIN(batch, deepest) if deepest else PLAIN(batch)  # noqa: E731
    return drive_plan(plan, requests, lambda request, k, j: accept(request, j), lambda k: k, cost, steps, seed)


def _static_rate(batch: int, probs: list[float], depth: int) -> float:
    if depth == 0:
        return batch / PLAIN(batch)
    expected, through = 1.0, 1.0
    for p in probs[:depth]:
        through *= p
        expected += through
    return batch * expected / CHAIN(batch, depth)


@pytest.mark.parametrize("batch,probs", [(1, [0.9, 0.9, 0.9, 0.9]), (16, [0.8, 0.3, 0.1, 0.1]),
                                         (64, [0.7, 0.2, 0.1, 0.1]), (64, [0.1, 0.1, 0.1, 0.1])])
def test_goodput_plan_is_near_the_best_static_chain(batch, probs):
    """Acceptance falling with the draft position makes a short chain the best shape at load; the plan finds
    it (or no drafting, or the full chain) within a few percent."""
    plan = AdaptivePlan(max_drafts=4, chains=(1, 2, 3, 4))
    got, depths = _drive_shapes(plan, _requests(batch), lambda r, j: probs[j])
    rates = [_static_rate(batch, probs, d) for d in range(5)]
    best = max(range(5), key=lambda d: rates[d])
    assert got >= 0.96 * rates[best], (got, rates, best)
    assert sum(d == best for d in depths[-1000:]) > 900, (best, sorted(set(depths[-1000:])))


def test_a_request_may_draft_deeper_than_its_neighbour():
    """Per-position counts: a request whose second drafts always fail drafts one, its neighbour the step's
    depth, in the same steps."""
    plan = AdaptivePlan(max_drafts=3, chains=(1, 2, 3))
    good, bad = _requests(2)
    _drive_shapes(plan, [good, bad], lambda r, j: 0.95 if r is good or j == 0 else 0.0, steps=600)
    assert plan.step_drafts([good, bad])
    assert plan.num_drafts(good) == plan.shape >= 2 and plan.num_drafts(bad) == 1


TEXTS = ["The capital of France is", "def fibonacci(n):", "One, two, three, four,", "Water boils at",
         "Once upon a time", "import numpy as np", "The quick brown fox", "Monday, Tuesday,"]


def test_goodput_shapes_are_lossless_with_real_acceptance(smollm2_dir):
    """The bundled head on SmolLM2 on a tree server (top-2, 3 steps, 6 drafts), requests arriving while others
    run: greedy output equals plain greedy while the plan moves between the tree and chains of 1 to 3 drafts
    step to step (the chains by the chain programs, the tree by the general search). Step times
    come from a cost model that makes every verified row dear, so short chains win at times."""
    from specserve import draft_heads

    config = replace(tight_config(str(smollm2_dir), 2000), dtype="float32")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [tokenizer(text).input_ids for text in TEXTS]
    plain, _ = build_engine_core(config, progress=False)
    expected, _ = run_staggered(plain, prompts, max_tokens=16)
    spec = SpecConfig("EAGLE3", str(draft_heads.SMOLLM2_HEAD), 3, 2, 7, adaptive=True, policy="goodput")
    engine, _ = build_engine_core(replace(config, spec=spec), progress=False)
    plan, observe = engine.observer, engine.observer.observe_step
    engine.observer.observe_step = lambda drafted, size, seconds: observe(
        drafted, size, 1.0 + (0.3 * (plan.shape + 1) * size if drafted else 0.0))
    drafted = []
    step = engine.step
    engine.step = lambda: [d for d in step() if drafted.append(d.step_drafted) or True]
    outputs, _ = run_staggered(engine, prompts, max_tokens=16)
    assert outputs == expected
    assert engine.scheduler.allocator.num_used == 0
    assert len(set(drafted) - {0}) >= 2, sorted(set(drafted))
    assert sorted(engine.runner.program.chains) == [1, 2, 3] and engine.runner.program.num_runs > 0


@pytest.mark.gpu
@pytest.mark.parametrize("topk,num_draft_tokens", [(1, None), (2, 6)])
def test_every_shape_replays_captured_graphs_losslessly(tiny_checkpoint, tmp_path, topk, num_draft_tokens):
    """On a GPU with CUDA graphs and overlap: the draft plan picks depths 0..3 at random step to step (and the
    tree on a tree server), every chain depth runs from its own captured graphs, and greedy output equals
    HF's."""
    from engine_runs import hf_greedy

    path = tiny_checkpoint("llama", True)
    write_peaked_random_head(path, tmp_path)
    prompts = make_prompts(512, seed=6)
    spec = SpecConfig("EAGLE3", str(tmp_path), 3, topk, num_draft_tokens, adaptive=True, policy="goodput")
    engine, _ = build_engine_core(replace(tight_config(str(path), 400), device="cuda", spec=spec), progress=False)
    engine.overlap = True
    rng = random.Random(0)
    most = engine.scheduler.max_draft_tokens
    engine.scheduler.draft_plan = lambda request: rng.choice([0, 1, 2, 3, most])
    program = engine.runner.program
    depths = _watch_depths(program)
    outputs, _ = run_staggered(engine, prompts)
    assert outputs == hf_greedy(path, prompts, "cuda")
    assert {1, 2, 3} <= set(depths)
    assert all(chain.graphs for chain in program.chains.values())
    assert engine.scheduler.allocator.num_used == 0


def test_the_policy_flag_turns_the_adaptive_plan_on_and_names_it():
    from specserve.cli import build_parser, engine_config
    from specserve.engine.factory import draft_plan

    def spec_of(*argv):
        return engine_config(build_parser().parse_args(["serve", "--speculative-algorithm", "EAGLE3",
                                                        "--speculative-draft-model-path", "head", *argv])).spec

    assert spec_of().adaptive is False and spec_of().policy == "on-off"
    tiers = spec_of("--speculative-policy", "sglang-tiers")
    assert tiers.adaptive and isinstance(draft_plan(tiers), SglangTiers)
    goodput = spec_of("--speculative-policy", "goodput", "--speculative-num-steps", "4")
    assert goodput.adaptive and draft_plan(goodput).chains == (1, 2, 3)
    assert not spec_of("--speculative-policy", "goodput", "--disable-speculative-adaptive").adaptive
    with pytest.raises(ValueError, match="speculative-policy"):
        SpecConfig("EAGLE3", "head", policy="greedy")
