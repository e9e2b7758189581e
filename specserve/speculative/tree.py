"""Draft trees: the shape a proposer hands to verification.

Node 0 is the root: the last known token, whose KV the verify step computes. Nodes 1.. are draft tokens,
stored parents-first, so `parents[i] < i`. A chain is a tree in which every node has one child.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: list[int]  # tokens[0] is the root
    parents: list[int]  # parents[0] == -1

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents) or not self.tokens or self.parents[0] != -1:
            raise ValueError("a tree needs a root (parent -1) and one parent per token")
        if any(not 0 <= p < i for i, p in enumerate(self.parents[1:], start=1)):
            raise ValueError("parents must come before their children")

    @classmethod
    def chain(cls, root: int, drafts: list[int]) -> "DraftTree":
        return cls([root, *drafts], list(range(-1, len(drafts))))

    @property
    def num_drafts(self) -> int:
        return len(self.tokens) - 1

    def depths(self) -> list[int]:
        depth = [0] * len(self.tokens)
        for i in range(1, len(self.tokens)):
            depth[i] = depth[self.parents[i]] + 1
        return depth

    def children(self, node: int) -> list[int]:
        return [i for i, p in enumerate(self.parents) if p == node]

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: node i may attend to node j iff j is i or one of its ancestors."""
        n = len(self.tokens)
        mask = torch.eye(n, dtype=torch.bool)
        for i in range(1, n):
            mask[i] |= mask[self.parents[i]]
        return mask


def best_first_tree(root: int, candidates: list[tuple[int, int, float]], num_draft_tokens: int,
                    min_logp: float = -math.inf) -> DraftTree:
    """Keeps the `num_draft_tokens` candidates with the highest cumulative draft log-probability (EAGLE-2),
    of those scoring at least `min_logp` (pruning: fewer drafts, never others).

    `candidates` are (token, parent candidate index or -1 for the root, cumulative log-prob), parents listed
    before children. A child's score never exceeds its parent's, so the best-N set, and the set above any
    score, always include every kept node's ancestors; ties go to the earlier (shallower) candidate for the
    same reason.
    """
    order = sorted(range(len(candidates)), key=lambda i: (-candidates[i][2], i))[:num_draft_tokens]
    order = [i for i in order if candidates[i][2] >= min_logp]
    kept = sorted(order)  # candidate order is parents-first
    new_index = {old: new for new, old in enumerate(kept, start=1)}
    tokens, parents = [root], [-1]
    for old in kept:
        token, parent, _ = candidates[old]
        if parent != -1 and parent not in new_index:
            raise ValueError("a kept candidate's parent was dropped: scores must not increase with depth")
        tokens.append(token)
        parents.append(0 if parent == -1 else new_index[parent])
    return DraftTree(tokens, parents)
