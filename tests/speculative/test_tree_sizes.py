"""The goodput plan's trees of a few sizes, the pruning of a request's tree by its draft scores, and step costs
estimated from the distinct experts a MoE target's rows touch. Greedy output equals plain greedy with tree
sizes changing mid-request and pruning on."""
from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest
import torch

from specserve.config import ModelConfig, MoEConfig, SpecConfig
from specserve.core import Request, SamplingParams
from specserve.engine.factory import build_engine_core
from specserve.speculative.plan import AdaptivePlan, ExpertReads, expert_reads
from specserve.speculative.tree import best_first_tree
from specserve.speculative.verify import verify

from engine_runs import count_accepted, make_prompts, run_staggered, tight_config
from plan_drives import drive_plan
from tiny_checkpoints import write_peaked_random_head

TREES = ((15, 5), (7, 3))  # SpecConfig(num_steps=5, eagle_topk=4, num_draft_tokens=16).tree_sizes under goodput
# Acceptance at each depth given the one before was reached: a tree's width keeps more at every depth.
ACCEPT = {15: [0.9, 0.85, 0.8, 0.75, 0.7], 7: [0.88, 0.8, 0.7], "chain": [0.7, 0.5, 0.3, 0.2, 0.1]}
PLAIN = lambda b: 10.0 + 0.02 * b  # noqa: E731
STEP = lambda b, d, row: 11.0 + 0.02 * b + row * b * (d + 1)  # noqa: E731  (verified rows cost `row` each)


def _requests(n: int) -> list[Request]:
    return [Request(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=100), 100) for i in range(n)]


def _accept(drafts: int, depth: int) -> float:
    return ACCEPT[drafts][depth] if drafts in ACCEPT else ACCEPT["chain"][depth]


def _depth(drafts: int) -> int:
    return dict(TREES).get(drafts, drafts)


def _drive(plan: AdaptivePlan, requests, row: float, steps: int = 3000, seed: int = 0):
    """Steps each costing STEP at its deepest row's shape; a request accepts depth by depth with `_accept`."""
    cost = lambda batch, deepest: STEP(batch, deepest, row) if deepest else PLAIN(batch)  # noqa: E731
    return drive_plan(plan, requests, lambda request, k, j: _accept(k, j), _depth, cost, steps, seed)


def _static_rate(batch: int, drafts: int, row: float) -> float:
    if drafts == 0:
        return batch / PLAIN(batch)
    expected, through = 1.0, 1.0
    for j in range(_depth(drafts)):
        through *= _accept(drafts, j)
        expected += through
    return batch * expected / STEP(batch, drafts, row)


@pytest.mark.parametrize("batch,row,best", [(1, 0.06, 15), (16, 0.06, 7)])
def test_the_plan_picks_the_tree_size_the_costs_favour(batch, row, best):
    """Verified rows cheap (batch 1): the configured tree. Dear (batch 16): the smaller tree, which keeps most
    of the big one's acceptance for half its rows, beats it, every chain and plain decoding."""
    plan = AdaptivePlan(15, chains=(1, 2, 3, 4, 5), depth=5, trees=TREES)
    got, shapes = _drive(plan, _requests(batch), row)
    rates = {d: _static_rate(batch, d, row) for d in (0, 1, 2, 3, 4, 5, 7, 15)}
    assert max(rates, key=rates.get) == best, rates
    assert got >= 0.96 * rates[best], (got, rates)
    assert sum(s == best for s in shapes[-1000:]) > 900, sorted(set(shapes[-1000:]))


@pytest.mark.parametrize("steps,topk,tokens,sizes", [
    (5, 4, 16, ((15, 5), (7, 3))),
    (2, 4, 21, ((20, 2), (4, 1))),  # one level holds 4 drafts: halving 10 tokens to 5 makes no new size
    (2, 8, 64, ((63, 2), (8, 1), (3, 1))),
    (1, 4, 5, ((4, 1),)),
    (3, 4, 4, ((3, 3),)),  # no more drafts than the deepest chain: the configured tree alone
    (3, 1, None, ()),
])
def test_tree_sizes_shrink_strictly_for_small_and_odd_shapes(steps, topk, tokens, sizes):
    spec = SpecConfig("EAGLE3", None, steps, topk, tokens, adaptive=True, policy="goodput")
    assert spec.tree_sizes == sizes


def test_a_trees_tokens_come_from_its_own_counts_by_depth():
    """Two requests with the same mean acceptance: one always reaches depth 2 and stops, the other alternates
    0 and 4 accepted. Per-depth counts tell them apart where the mean could not, and each tree size keeps its
    own counts."""
    plan = AdaptivePlan(15, chains=(1, 2, 3, 4, 5), depth=5, trees=TREES)
    steady, bursty = _requests(2)
    for step in range(40):
        plan.observe_acceptance(steady, 15, 2)
        plan.observe_acceptance(bursty, 15, 0 if step % 2 else 4)
    assert set(steady.tree_positions) == {15} and not steady.drafts_reached
    assert steady.tree_positions[15][0][:3] == [40, 40, 40] and steady.tree_positions[15][1][:3] == [40, 40, 0]
    assert plan._tokens(steady, 15) == pytest.approx(3.0, abs=0.2)
    assert plan._tokens(bursty, 15) == pytest.approx(3.0, abs=0.3)
    # Depth 1 of the small tree has seen neither request: both stand at the recent requests' prior.
    assert plan._tokens(steady, 7) == pytest.approx(plan._tokens(bursty, 7))
    plan.observe_acceptance(steady, 11, 3)  # a tree cut short by the room left counts under no size
    assert set(steady.tree_positions) == {15}


def test_depths_a_pruned_tree_did_not_reach_are_not_counted_as_misses():
    plan = AdaptivePlan(15, chains=(1, 2, 3, 4, 5), depth=5, trees=TREES)
    (request,) = _requests(1)
    plan.observe_acceptance(request, 15, 2, depth=2)  # pruned to two levels, both accepted
    plan.observe_acceptance(request, 15, 1, depth=4)  # four levels, the second rejected
    reached, kept = request.tree_positions[15]
    assert reached[:3] == [2, 2, 0] and kept[:3] == [2, 1, 0]


def test_best_first_pruning_drops_low_scores_and_keeps_every_kept_nodes_ancestors():
    rng = random.Random(0)
    for _ in range(200):
        candidates = []
        for i in range(rng.randrange(1, 30)):
            parent = rng.randrange(-1, i)
            base = 0.0 if parent == -1 else candidates[parent][2]
            candidates.append((rng.randrange(100), parent, base + math.log(rng.random())))
        floor = math.log(rng.random())
        full = best_first_tree(7, candidates, 12)
        pruned = best_first_tree(7, candidates, 12, floor)
        kept = sorted(range(len(candidates)), key=lambda i: (-candidates[i][2], i))[:12]
        assert pruned.num_drafts == sum(candidates[i][2] >= floor for i in kept) <= full.num_drafts
        assert all(0 <= p < i for i, p in enumerate(pruned.parents[1:], start=1))  # ancestors all kept


def test_pruning_never_cuts_the_path_the_target_accepts():
    """A tree whose likely nodes are what the target says: pruning the unlikely ones verifies to the same
    tokens, and the whole accepted path survives the floor."""
    # (token, parent, cumulative log-prob): 5 -> 6 -> 7 likely; siblings 8, 9 and 6's child 10 unlikely.
    candidates = [(5, -1, math.log(0.9)), (8, -1, math.log(0.05)), (6, 0, math.log(0.8)), (9, 0, math.log(0.04)),
                  (7, 2, math.log(0.7)), (10, 2, math.log(0.02))]
    full = best_first_tree(4, candidates, 6)
    pruned = best_first_tree(4, candidates, 6, math.log(0.1))
    assert pruned.tokens == [4, 5, 6, 7] and full.num_drafts == 6
    target = {4: 5, 5: 6, 6: 7, 7: 11}  # the target's argmax after each token

    def logits(tree):
        rows = torch.full((len(tree.tokens), 16), -5.0)
        for i, token in enumerate(tree.tokens):
            rows[i, target.get(token, 0)] = 5.0
        return rows

    greedy = SamplingParams(temperature=0.0)
    assert verify(logits(pruned), pruned, greedy).tokens == verify(logits(full), full, greedy).tokens == [5, 6, 7, 11]


def test_pruning_floor_follows_what_a_verify_row_costs():
    """At a load where verified rows are dear the plan sets a floor on node probability; where they cost
    nothing beyond a plain step, none. Chains are not pruned."""
    dear = AdaptivePlan(15, chains=(1, 2, 3, 4, 5), depth=5, trees=TREES)
    requests = _requests(16)
    _drive(dear, requests, 0.06, steps=400)
    assert dear.step_drafts(requests) and dear.shape == 7
    assert 0.05 < dear.draft_min_prob(requests[0]) < 1.0
    cheap = AdaptivePlan(15, chains=(1, 2, 3, 4, 5), depth=5, trees=TREES)
    requests = _requests(4)
    _drive(cheap, requests, 0.0, steps=400)
    assert cheap.step_drafts(requests) and cheap.shape == 15
    assert cheap.draft_min_prob(requests[0]) < 0.05
    chains = AdaptivePlan(5, chains=(1, 2, 3, 4, 5))
    _drive(chains, _requests(16), 0.06, steps=200)
    chains.step_drafts(_requests(16))
    assert chains.draft_min_prob(_requests(1)[0]) == 0.0


QWEN3_30B_A3B = ModelConfig("Qwen3MoeForCausalLM", 151936, 2048, 6144, 48, 32, 4, 128,
                            moe=MoEConfig(128, 8, 768, tuple(range(48))))


def test_the_moe_estimate_grows_with_distinct_experts():
    reads = expert_reads(QWEN3_30B_A3B)
    assert reads.num_experts == 128 and reads.top_k == 8 and reads.expert_params == 3 * 2048 * 768 * 48
    assert reads.distinct(1) == pytest.approx(8) and reads.distinct(10_000) == pytest.approx(128)
    assert 0.5 < reads.routed_share(1) < reads.routed_share(16) < 1
    assert reads.effective_rows(32, 32) == pytest.approx(32)  # a plain step is its own rows
    # Beyond the rows' share of the other weights, a step's effective rows are its distinct experts.
    share = reads.routed_share(16)
    per_expert = {rows: (reads.effective_rows(rows, 16) - (1 - share) * rows) / reads.distinct(rows)
                  for rows in (16, 32, 64, 96)}
    assert len({round(v, 9) for v in per_expert.values()}) == 1
    assert expert_reads(replace(QWEN3_30B_A3B, moe=None)) is None

    def estimate(experts: ExpertReads | None, batch: int) -> float:
        """Chain 1's cost, estimated from a measured chain of 5 at 2x a plain step's cost."""
        plan = AdaptivePlan(5, chains=(1, 2, 3, 4, 5), experts=experts)
        plan.shape_cost[(5, batch)] = 2.0
        return plan._shape_cost(1, batch, 1.0)

    # Dense: the extra cost scales with verified rows, 2 of 6. MoE at batch 16: a plain step touches 82 of the
    # 128 experts, chain 1's rows 112 and chain 5's nearly all, so chain 1 costs most of what chain 5 does.
    assert estimate(None, 16) == pytest.approx(1.0 + 2 / 6)
    assert estimate(reads, 16) > 1.7
    # At batch 256 a plain step already reads every expert: the extra rows read only the other weights.
    other = 1 - reads.routed_share(256)
    expected = 1.0 + (other * 512 + (1 - other) * 256) / (other * 1536 + (1 - other) * 256)
    assert estimate(reads, 256) == pytest.approx(expected)


def test_the_factory_gives_the_plan_tree_sizes_and_the_pruning_hook(tmp_path, tiny_checkpoint):
    path = tiny_checkpoint("llama", True)
    write_peaked_random_head(path, tmp_path)
    spec = SpecConfig("EAGLE3", str(tmp_path), 4, 2, 12, adaptive=True, policy="goodput")
    engine, _ = build_engine_core(replace(tight_config(str(path), 400), spec=spec), progress=False)
    assert engine.observer.trees == {11: 4, 5: 2} and engine.observer.experts is None
    assert engine.scheduler.draft_prune == engine.observer.draft_min_prob
    assert engine.runner.proposer.levels(5) == 2 and engine.runner.proposer.levels(11) == 4
    assert engine.runner.proposer.levels(3) == 4  # a chain's budget on a tree server: as before
    default = replace(spec, policy="on-off")
    engine, _ = build_engine_core(replace(tight_config(str(path), 400), spec=default), progress=False)
    assert engine.scheduler.draft_prune is None and engine.observer.trees == {11: 4}
    # Simulated acceptance accepts a drawn depth along the tree: pruning by the head's scores would cap it.
    simulated = replace(spec, simulate_accept_len=3.0)
    engine, _ = build_engine_core(replace(tight_config(str(path), 400), spec=simulated), progress=False)
    assert engine.scheduler.draft_prune is None and engine.observer.trees == {11: 4, 5: 2}


@pytest.mark.parametrize("program", [False, True])
def test_tree_sizes_and_pruning_are_lossless_mid_request(tmp_path, tiny_checkpoint, noisy_draft_model, switches,
                                                         program):
    """A tree server (top-2, 4 steps, 11 drafts; trees of 11 and 5, chains of 1-4) under the goodput policy:
    each step each request drafts a budget drawn at random and prunes its tree at a random floor, while
    requests arrive, are preempted and finish. Greedy output equals plain greedy: by the general search with a
    noisy copy of the target as draft model (trees of every size, pruned), and by the step programs of every
    tree size with an EAGLE-3 head (no pruning: a program's shapes are fixed)."""
    switches(tree_program_on_cpu=program)
    target = tiny_checkpoint("llama", True)
    config = tight_config(str(target), 200)
    prompts = make_prompts(512, seed=6)
    plain, _ = build_engine_core(config, progress=False)
    expected, _ = run_staggered(plain, prompts)
    if program:
        write_peaked_random_head(target, tmp_path)
        spec = SpecConfig("EAGLE3", str(tmp_path), 4, 2, 12, adaptive=True, policy="goodput")
    else:
        spec = SpecConfig("DRAFT_MODEL", str(noisy_draft_model), 4, 2, 12, adaptive=True, policy="goodput")
    engine, _ = build_engine_core(replace(config, spec=spec), progress=False)
    rng = random.Random(1)
    engine.scheduler.draft_plan = lambda request: rng.choice([1, 3, 5, 8, 11])
    engine.scheduler.draft_gate = lambda requests: True
    engine.scheduler.draft_prune = lambda request: rng.choice([0.0, 0.05, 0.3])
    trees = []  # (drafts scheduled, drafts verified, depth) of every tree the general search built
    propose = engine.runner.proposer.propose

    def watched(batch):
        out = propose(batch)
        trees.extend((batch.seqs[i].num_draft_tokens, t.num_drafts, max(t.depths())) for i, t in out.items())
        return out
    engine.runner.proposer.propose = watched
    accepted = count_accepted(engine)
    observed = []  # (accepted, verified depth) the plan was told, per drafting request and step
    observe = engine.observer.observe_acceptance
    engine.observer.observe_acceptance = lambda r, d, a, depth=None: (observed.append((a, depth)),
                                                                      observe(r, d, a, depth))
    outputs, _ = run_staggered(engine, prompts)
    assert outputs == expected
    assert engine.scheduler.allocator.num_used == 0 and engine.scheduler.num_preemptions > 0
    if program:
        assert sorted(engine.runner.program.trees) == [5, 11]
        assert all(tree.num_runs > 0 for tree in engine.runner.program.trees.values())
    else:  # pruned trees verify fewer drafts than scheduled; a budget of 5 searches the small tree's 2 levels
        assert any(verified < scheduled for scheduled, verified, _ in trees)
        assert max(depth for scheduled, _, depth in trees if scheduled == 5) == 2
        assert max(depth for scheduled, _, depth in trees if scheduled == 11) > 2
        assert max(accepted) >= 3, accepted
        assert all(depth is not None and a <= depth for a, depth in observed)
        assert {depth for _, depth in observed} <= {depth for _, _, depth in trees}


@pytest.mark.gpu
def test_every_tree_size_replays_its_captured_graphs_losslessly(tiny_checkpoint, tmp_path):
    """On a GPU with CUDA graphs and overlap: budgets drawn at random step to step take chains of 1 and 3 and
    trees of 5 and 11 drafts, each from its own captured graphs (8 takes the 11-tree with a limit), and greedy
    output equals HF's."""
    from engine_runs import hf_greedy

    path = tiny_checkpoint("llama", True)
    write_peaked_random_head(path, tmp_path)
    prompts = make_prompts(512, seed=6)
    spec = SpecConfig("EAGLE3", str(tmp_path), 4, 2, 12, adaptive=True, policy="goodput")
    engine, _ = build_engine_core(replace(tight_config(str(path), 400), device="cuda", spec=spec), progress=False)
    engine.overlap = True
    rng = random.Random(0)
    engine.scheduler.draft_plan = lambda request: rng.choice([0, 1, 3, 5, 8, 11])
    program = engine.runner.program
    depths, launch = [], program.launch
    program.launch = lambda batch, timer: depths.append(max(s.num_draft_tokens for s in batch.seqs)) or launch(
        batch, timer)
    outputs, _ = run_staggered(engine, prompts)
    assert outputs == hf_greedy(path, prompts, "cuda")
    assert {5, 11} <= set(depths) and sorted(program.trees) == [5, 11]
    assert all(tree.graphs and tree.num_runs for tree in program.trees.values())
    assert engine.scheduler.allocator.num_used == 0


@pytest.mark.parametrize("kind", ["qwen3-moe", "deepseek-v3"])
def test_the_goodput_plan_chooses_shapes_on_moe_targets_losslessly(tmp_path, tiny_checkpoint, kind):
    """A tree server under the goodput policy on the MoE and MLA targets: the plan is given the target's expert
    reads, moves between shapes step to step (step times from a cost model in which deeper shapes cost more),
    and greedy output equals plain greedy."""
    target = tiny_checkpoint(kind, True)
    config = tight_config(str(target), 400)
    prompts = make_prompts(512, seed=6)
    plain, _ = build_engine_core(config, progress=False)
    expected, _ = run_staggered(plain, prompts)
    write_peaked_random_head(target, tmp_path)
    spec = SpecConfig("EAGLE3", str(tmp_path), 4, 2, 12, adaptive=True, policy="goodput")
    engine, _ = build_engine_core(replace(config, spec=spec), progress=False)
    plan, observe = engine.observer, engine.observer.observe_step
    assert plan.experts is not None and plan.experts.top_k > 1
    engine.observer.observe_step = lambda drafted, size, seconds: observe(
        drafted, size, 1.0 + (0.04 * (plan.shape + 1) * size if drafted else 0.0))
    shapes = []
    step = engine.step
    engine.step = lambda: [d for d in step() if shapes.append(d.step_drafted) or True]
    outputs, _ = run_staggered(engine, prompts)
    assert outputs == expected
    assert len(set(shapes) - {0}) >= 2, sorted(set(shapes))
    assert engine.scheduler.allocator.num_used == 0
