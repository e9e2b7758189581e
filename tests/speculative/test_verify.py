"""Verification on hand-made tensors: greedy follows the argmax, sampling keeps the target distribution."""
from __future__ import annotations

import pytest
import torch

from specserve.core import SamplingParams
from specserve.speculative.tree import DraftTree, best_first_tree
from specserve.speculative.verify import verify

from distribution_checks import chi2_999

GREEDY = SamplingParams(temperature=0.0)


def _logits_preferring(tokens: list[int], vocab: int = 10) -> torch.Tensor:
    logits = torch.zeros(len(tokens), vocab)
    logits[torch.arange(len(tokens)), torch.tensor(tokens)] = 5.0
    return logits


def test_greedy_chain_accepts_the_matching_prefix_plus_a_bonus():
    tree = DraftTree.chain(root=1, drafts=[4, 5, 6])
    # The target wants 4 after the root, 5 after 4, then 9 (not 6) after 5.
    verdict = verify(_logits_preferring([4, 5, 9, 0]), tree, GREEDY)
    assert verdict.tokens == [4, 5, 9] and verdict.accepted_nodes == [1, 2]


def test_greedy_all_accepted_gives_every_draft_and_a_bonus():
    tree = DraftTree.chain(root=1, drafts=[4, 5])
    assert verify(_logits_preferring([4, 5, 7]), tree, GREEDY).tokens == [4, 5, 7]


def test_greedy_tree_follows_the_branch_the_target_picks():
    #        0(root=1)
    #       /        \
    #     1(3)       2(4)
    #      |          |
    #     3(7)       4(8)
    tree = DraftTree([1, 3, 4, 7, 8], [-1, 0, 0, 1, 2])
    verdict = verify(_logits_preferring([4, 0, 8, 0, 2]), tree, GREEDY)
    assert verdict.tokens == [4, 8, 2] and verdict.accepted_nodes == [2, 4]


def test_tree_masks_and_best_first_selection():
    tree = DraftTree([1, 3, 4, 7], [-1, 0, 0, 1])
    assert tree.depths() == [0, 1, 1, 2]
    expected = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    assert torch.equal(tree.ancestor_mask(), expected)
    candidates = [(3, -1, -0.1), (4, -1, -2.0), (7, 0, -0.5), (8, 0, -3.0), (9, 2, -0.9)]
    best = best_first_tree(root=1, candidates=candidates, num_draft_tokens=3)
    assert best.tokens == [1, 3, 7, 9] and best.parents == [-1, 0, 1, 2]
    with pytest.raises(ValueError):
        DraftTree([1, 2], [-1, 1])


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=4)])
def test_speculative_sampling_keeps_the_target_distribution(params):
    """A bigram 'target' and a different bigram 'draft'. The draft proposes a top-2 tree of depth 2; the
    joint law of the first two emitted tokens must be the target's own, under each request's filters."""
    vocab, trials = 6, 5000
    g = torch.Generator().manual_seed(0)
    target_table = torch.randn(vocab, vocab, generator=g) * 1.2
    draft_table = torch.randn(vocab, vocab, generator=g) * 1.2
    target_p = _filtered(target_table, params)
    root = 2

    def draft_tree() -> DraftTree:
        tokens, parents = [root], [-1]
        for first in draft_table[root].topk(2).indices.tolist():
            tokens.append(first)
            parents.append(0)
            node = len(tokens) - 1
            for second in draft_table[first].topk(2).indices.tolist():
                tokens.append(second)
                parents.append(node)
        return DraftTree(tokens, parents)

    tree = draft_tree()
    logits = target_table[torch.tensor(tree.tokens)]
    counts = torch.zeros(vocab, vocab)
    rng = torch.Generator().manual_seed(1)
    for _ in range(trials):
        tokens = verify(logits, tree, params, rng).tokens
        if len(tokens) == 1:  # only the bonus: the next step would sample the target directly
            tokens.append(torch.multinomial(target_p[tokens[0]], 1, generator=rng).item())
        counts[tokens[0], tokens[1]] += 1
    expected = target_p[root][:, None] * target_p * trials
    support = expected > 0
    assert counts[~support].sum() == 0, "emitted a token the target's filters rule out"
    cells = support & (expected > 5)  # chi-square needs enough expected mass per cell
    chi2 = ((counts - expected)[cells] ** 2 / expected[cells]).sum().item()
    assert chi2 < chi2_999(int(cells.sum()) - 1), chi2


def _filtered(table: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    from specserve.sampling.sampler import filtered_probs

    return filtered_probs(table, [params] * table.shape[0])
