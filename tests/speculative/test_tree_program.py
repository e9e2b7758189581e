"""EAGLE-2 trees as one program per step (speculative/programs/tree.py), run eagerly on the CPU: the same trees,
acceptance and outputs as the general tree search, lossless against HF, simulated acceptance the same, and the
attention contract its kernel follows (context through the page table, then a tail of scattered slots)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specserve.config import SpecConfig
from specserve.engine.factory import build_engine_core
from specserve.speculative.accept import accept_tree_sampled
from specserve.speculative.programs.tree import TreeGraphs
from specserve.layers.attention import AttentionMetadata, attend_rows
from specserve.speculative.simulate import best_path
from specserve.speculative.tree import DraftTree

from distribution_checks import assert_drawn_from
from engine_runs import (count_accepted, hf_greedy, make_prompts, run_mixed_sampling, run_staggered, tight_config,
                         watch_drafting_paths)
from tiny_checkpoints import write_peaked_random_head

TREE = dict(num_steps=4, eagle_topk=3, num_draft_tokens=9)


def _tree_engine(tmp_path, tiny_checkpoint, switches, **spec):
    switches(tree_program_on_cpu=True)
    path = tiny_checkpoint("llama", True)
    write_peaked_random_head(path, tmp_path)
    config = replace(tight_config(str(path), 200), spec=SpecConfig("EAGLE3", str(tmp_path), **{**TREE, **spec}))
    engine, _ = build_engine_core(config, progress=False)
    assert isinstance(engine.runner.program, TreeGraphs)
    return engine, path


def test_tree_program_is_lossless_and_accepts_what_the_search_accepts(tmp_path, tiny_checkpoint, switches):
    """Staggered arrivals with preemption: the program's output is HF's, and every step accepts as many
    drafts as the general search's tree does (so both built the same trees, up to what verification sees)."""
    prompts = make_prompts(512, seed=4)
    runs = []
    for program in (True, False):
        engine, path = _tree_engine(tmp_path, tiny_checkpoint, switches)
        if not program:
            engine.runner.program = None
        accepted = count_accepted(engine)
        outputs, _ = run_staggered(engine, prompts)
        if program:
            assert engine.runner.program.num_runs > 10 and engine.scheduler.num_preemptions > 0
        alloc = engine.scheduler.allocator
        assert alloc.num_free == alloc.num_pages
        runs.append((outputs, accepted))
    assert runs[0][0] == hf_greedy(path, prompts)
    assert runs[0] == runs[1]


def _hand_made_tree(bs: int, limit: list[int]):
    """Two levels of top-2 plus a third: candidates (token, parent, score) level by level, as _search makes them."""
    g = TreeGraphs.__new__(TreeGraphs)  # only what _select and _accept read
    g.depth, g.num_drafts, g.topk, g.device = 3, 5, 2, torch.device("cpu")
    g.candidate_depth = torch.tensor([1, 1, 2, 2, 2, 2, 3, 3, 3, 3])
    g.root_ids, g.root_slots = torch.full((bs,), 7), torch.full((bs,), 100)
    g.target_scratch = torch.arange(200, 200 + 5 * bs).view(bs, 5)
    g.limit = torch.tensor(limit)
    tokens = torch.tensor([[10, 11, 20, 21, 22, 23, 30, 31, 32, 33]] * bs)
    parents = torch.tensor([[-1, -1, 0, 0, 1, 1, 2, 2, 4, 4]] * bs)
    scores = torch.tensor([[-0.1, -1.0, -0.2, -2.0, -1.1, -3.0, -0.3, -2.5, -1.2, -4.0]] * bs)
    return g, g._select(bs, tokens, parents, scores)


def test_tree_selection_keeps_the_best_nodes_parents_first():
    _, nodes = _hand_made_tree(1, [5])
    # Best five: candidates 0, 2, 6, 1, 4 -> nodes in candidate order 0, 1, 2, 4, 6.
    assert nodes["tokens"].tolist() == [[7, 10, 11, 20, 22, 30]]
    assert nodes["parent"].tolist() == [[0, 0, 0, 1, 2, 3]]
    assert nodes["depth"].tolist() == [[0, 1, 1, 2, 2, 3]]
    assert nodes["path"][0, 5].tolist() == [1, 3, 5] and nodes["path"][0, 4, :2].tolist() == [2, 4]
    assert nodes["slots"].tolist() == [[100, 200, 201, 202, 203, 204]]


def test_tree_acceptance_follows_the_targets_choices():
    g, nodes = _hand_made_tree(5, [5, 5, 5, 2, 5])
    best = torch.tensor([[10, 20, 0, 30, 0, 99],  # the deepest path, then the target's token
                         [11, 0, 22, 0, 7, 0],  # the other branch
                         [5, 0, 0, 0, 0, 0],  # no draft matches
                         [10, 20, 0, 30, 0, 99],  # capped at the two drafts the sequence was scheduled with
                         [10, 21, 0, 0, 0, 0]])  # a first-level match whose child is not in the tree
    tokens, accepted, _ = g._accept(5, nodes, best, forced=None)
    out = [t[: a + 1] for t, a in zip(tokens.tolist(), accepted.tolist())]
    assert out == [[10, 20, 30, 99], [11, 22, 7], [5], [10, 20, 30], [10, 21]]
    # Simulated: each node's first child, `forced` levels down (capped by the limit).
    tokens, accepted, _ = g._accept(5, nodes, best, forced=torch.tensor([1, 3, 0, 3, 9]))
    out = [t[: a + 1] for t, a in zip(tokens.tolist(), accepted.tolist())]
    assert out == [[10, 20], [10, 20, 30, 0], [5], [10, 20, 30], [10, 20, 30, 0]]


def test_simulated_acceptance_passes_over_a_first_child_too_shallow():
    """Simulated acceptance goes the drawn count down each node's first child among those whose subtree is that
    deep: a shallow first child is passed over, a tree shallower than the count caps it (as does a node left
    out of the tree). The same on the runner's path (simulate.best_path) and the program's (`_leaf`)."""
    parents = [-1, 0, 0, 2, 3, 2]  # root -> 1 (a leaf); root -> 2 -> 3 -> 4; root -> 2 -> 5
    forced = [0, 1, 2, 3, 5]
    expected = [[], [1], [2, 3], [2, 3, 4], [2, 3, 4]]
    tree = DraftTree(list(range(10, 16)), parents)
    assert [best_path(tree, n) for n in forced] == expected
    g = TreeGraphs.__new__(TreeGraphs)
    g.depth, g.num_drafts, g.device = 3, 5, torch.device("cpu")
    bs = len(forced)
    nodes = {"parent": torch.tensor([[0] + parents[1:]] * bs), "depth": torch.tensor([tree.depths()] * bs),
             "in_tree": torch.ones(bs, 6, dtype=torch.bool)}
    leaf = g._leaf(bs, nodes, best=None, forced=torch.tensor(forced))
    assert leaf.tolist() == [path[-1] if path else 0 for path in expected]
    nodes["in_tree"][:, 4] = False  # 2 -> 3 is now as deep as 2 -> 5, and 3 comes first
    assert g._leaf(bs, nodes, best=None, forced=torch.tensor(forced)).tolist() == [0, 1, 3, 3, 3]


def test_simulated_acceptance_stops_before_a_draft_the_grammar_forbids():
    """Under a grammar, verification's logits carry -inf for forbidden tokens: the drawn path is cut before the
    first draft its parent's row forbids, and the bonus comes from the row where it stopped."""
    import random

    from specserve.core import SamplingParams
    from specserve.speculative.simulate import simulated_verdict

    tree = DraftTree([7, 3, 4, 5], [-1, 0, 1, 2])  # a chain: root 7 -> 3 -> 4 -> 5
    logits = torch.zeros(4, 8)
    logits[1, 4] = float("-inf")  # after 3, the grammar forbids 4
    logits[1, 6] = 5.0  # and the target would say 6
    verdict = simulated_verdict(logits, tree, SamplingParams(temperature=0.0), 4.0, random.Random(0), None)
    assert verdict.accepted_nodes == [1] and verdict.tokens == [3, 6]
    logits[1, 4] = 0.0
    verdict = simulated_verdict(logits, tree, SamplingParams(temperature=0.0), 4.0, random.Random(0), None)
    assert verdict.accepted_nodes == [1, 2, 3]


def test_sampled_tree_acceptance_keeps_the_target_distribution():
    """The program's walk for sampled rows on the hand-made tree (root -> 10 -> 20 -> 30, root -> 11 -> 22) with
    fixed target distributions after each node: the first token is drawn from the root's, and the token after
    each drafted prefix (when a row emitted it) from that node's. With two drafts scheduled (the two best
    nodes, 10 and 20, in the tree) nothing comes after the third token."""
    torch.manual_seed(0)
    rows, vocab = 40_000, 32
    _, nodes = _hand_made_tree(rows, [5] * rows)
    probs = torch.softmax(torch.randn(6, vocab), dim=-1)
    for node, child_tokens in ((0, (10, 11)), (1, (20,)), (2, (22,)), (3, (30,))):
        probs[node, list(child_tokens)] += 0.3  # the drafts are likely, so enough rows go deep
    probs[4, 5] = 0.0  # a token the target never takes after node 4
    probs = probs / probs.sum(dim=-1, keepdim=True)
    prefixes = {(): 0, (10,): 1, (11,): 2, (10, 20): 3, (11, 22): 4, (10, 20, 30): 5}

    def emitted(nodes):
        leaf, after = accept_tree_sampled(nodes, lambda node: probs[node], depth=3, max_children=2)
        path_tokens = nodes["tokens"].gather(1, nodes["path"].gather(1, leaf[:, None, None].expand(-1, 1, 3))[:, 0])
        depth = nodes["depth"].gather(1, leaf[:, None])[:, 0]
        return [t[:d] + [a] for t, d, a in zip(path_tokens.tolist(), depth.tolist(), after.tolist())]

    out = emitted(nodes)
    for prefix, node in prefixes.items():
        along = [e for e in out if tuple(e[: len(prefix)]) == prefix]
        assert all(len(e) > len(prefix) for e in along)
        assert_drawn_from([e[len(prefix)] for e in along], probs[node])
    _, capped = _hand_made_tree(rows, [2] * rows)
    out = emitted(capped)
    assert max(len(e) for e in out) == 3
    assert all(len(e) == 1 for e in out if e[0] == 11)  # node 2 (11) is out of the tree: a draw, not a draft
    assert_drawn_from([e[0] for e in out], probs[0])
    assert_drawn_from([e[1] for e in out if e[0] == 10], probs[1])


def test_sampled_requests_without_a_seed_take_the_tree_program(tmp_path, tiny_checkpoint, switches):
    """Greedy, top-k 1 and fully sampled rows in one batch, all through the program (the general search never
    drafts): the greedy and top-k 1 rows equal HF's greedy output, the fully sampled rows do not, and every
    page comes back."""
    engine, path = _tree_engine(tmp_path, tiny_checkpoint, switches)
    general, _ = watch_drafting_paths(engine)
    prompts = make_prompts(512, seed=4)[:6]
    outputs = run_mixed_sampling(engine, prompts)
    reference = hf_greedy(path, prompts, max_tokens=24)
    assert [out == ref for out, ref in zip(outputs, reference)] == [True, True, False] * 2
    assert engine.runner.program.num_runs > 5 and general and not any(general)
    alloc = engine.scheduler.allocator
    assert alloc.num_free == alloc.num_pages


def test_tree_program_simulates_acceptance_like_the_search(tmp_path, tiny_checkpoint, switches):
    prompts = make_prompts(512, seed=2)
    runs = []
    for program in (True, False):
        engine, _ = _tree_engine(tmp_path, tiny_checkpoint, switches, simulate_accept_len=2.5)
        if not program:
            engine.runner.program = None
        accepted = count_accepted(engine)
        outputs, _ = run_staggered(engine, prompts)
        runs.append((outputs, accepted))
    assert runs[0] == runs[1]
    assert abs(1 + sum(runs[0][1]) / len(runs[0][1]) - 2.5) < 0.25


@pytest.mark.parametrize("tail", [False, True])
def test_row_attention_reads_the_context_then_the_tail(tail):
    """attend_rows (the decode kernel's contract, which the GPU tests hold the kernel to) against SDPA over
    slots listed by hand."""
    torch.manual_seed(0)
    page, heads, kv_heads, dim = 4, 4, 2, 8
    pool = torch.randn(2, 64, kv_heads, dim)
    tables = torch.tensor([[3, 1, 0], [2, 5, 6]], dtype=torch.int32)
    lens = torch.tensor([6, 9], dtype=torch.int32)
    tails = torch.tensor([[40, 41, 0], [50, 0, 0]]) if tail else None
    tail_lens = torch.tensor([2, 1], dtype=torch.int32) if tail else None
    q = torch.randn(2, heads, dim)
    meta = AttentionMetadata(slot_mapping=torch.zeros(2, dtype=torch.long), block_tables=tables, seq_lens=lens,
                             page_size=page, tail_slots=tails, tail_lens=tail_lens)
    out = attend_rows(q, pool, meta, 0.3)
    for b in range(2):
        slots = [int(tables[b, p // page]) * page + p % page for p in range(int(lens[b]))]
        if tail:
            slots += tails[b, : int(tail_lens[b])].tolist()
        k = pool[0, slots].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)  # [H, L, D]
        v = pool[1, slots].repeat_interleave(heads // kv_heads, dim=1).transpose(0, 1)
        expected = torch.softmax(q[b][:, None, :] @ k.transpose(1, 2) * 0.3, dim=-1) @ v  # [H, 1, D]
        torch.testing.assert_close(out[b].view(heads, dim), expected[:, 0], atol=1e-5, rtol=1e-5)
