"""Simulated acceptance, for speed studies of models whose trained drafters we don't have.

Drafting and verification run in full, so a step costs what it would cost; only the verdict is replaced.
Each request and step, the number of accepted drafts is drawn with mean tau - 1 (acceptance length tau counts
the bonus token) from the two integers around it, and the accepted tokens are the drafts along the tree's
best path that is that deep: from the root, each node's top-ranked child (its first) among those whose
subtree reaches the drawn depth, so a tree shallower along its first children still accepts the count drawn
(only a tree shallower than the count caps it). The bonus token is the target's own choice after the last.
The output is therefore not the target's: never on by default, and every figure made with it is labelled
simulated.
"""
from __future__ import annotations

import math
import random

import torch

from specserve.sampling.sampler import sample
from specserve.core import SamplingParams
from specserve.speculative.tree import DraftTree
from specserve.speculative.verify import Verdict


def draw_num_accepted(tau: float, rng: random.Random) -> int:
    """Accepted drafts, with mean tau - 1 and the least spread an integer draw can have."""
    mean = tau - 1.0
    low = math.floor(mean)
    return low + (1 if rng.random() < mean - low else 0)


def best_path(tree: DraftTree, wanted: int) -> list[int]:
    """The first `wanted` nodes (fewer if the tree is shallower) along the top-ranked children that reach."""
    depths = tree.depths()
    deepest = list(depths)  # the depth of each node's deepest descendant (itself included)
    for node in range(len(depths) - 1, 0, -1):  # parents come before their children
        parent = tree.parents[node]
        deepest[parent] = max(deepest[parent], deepest[node])
    target = min(wanted, deepest[0])
    path, node = [], 0
    while len(path) < target:
        node = next(child for child in tree.children(node) if deepest[child] >= target)
        path.append(node)
    return path


def simulated_verdict(target_logits: torch.Tensor, tree: DraftTree, params: SamplingParams, tau: float,
                      rng: random.Random, seed: int | None) -> Verdict:
    """`target_logits` as verification sees them, grammar masks applied: the path stops before a draft its
    grammar forbids (-inf in its parent's row), so a constrained output stays valid under simulation."""
    accepted = _allowed_prefix(target_logits, tree, best_path(tree, draw_num_accepted(tau, rng)))
    last = accepted[-1] if accepted else 0
    bonus = sample(target_logits[last:last + 1], [params], [seed]).item()
    return Verdict(accepted, [tree.tokens[n] for n in accepted] + [bonus])


def _allowed_prefix(target_logits: torch.Tensor, tree: DraftTree, path: list[int]) -> list[int]:
    for i, node in enumerate(path):
        if torch.isneginf(target_logits[tree.parents[node], tree.tokens[node]]):
            return path[:i]
    return path
