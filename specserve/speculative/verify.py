"""Verification: (target distributions over a draft tree, the tree, sampling params) -> accepted tokens.

A pure function, independent of models and batches.

Algorithm (lossless for any drafter whose drafts are chosen deterministically, as EAGLE's top-k and greedy
chains are). Walk down from the root. At node n, let p be the target's distribution for the next token
after n, with the request's temperature, top-k, top-p and min-p applied (greedy: a point mass on the
argmax). Try n's children in order. Child c with token x is accepted with probability r(x) / sum(r), where r
starts as p; if rejected, r(x) is set to 0 and the next child is tried. An accepted child becomes the new
n. If every child is rejected (or n is a leaf), one more token is drawn from r normalised: the bonus token.

Why it is exact: a token x is emitted at n either by accepting child x, with probability
prod(1 - p(earlier children)) * p(x) / (1 - p(earlier)) = p(x), or as the bonus, with probability
(1 - p(all children)) * p(x) / (1 - p(all children)) = p(x) for x outside the children. So each emitted
token is distributed exactly as the target's p given what came before, which is sampling the target alone.
For greedy requests this reduces to "follow the child equal to the argmax, then emit the argmax".

Seeded requests walk another way (`verify_seeded`), so that their output is the same with or without
speculation and whatever shares their batches: at each node the target's own seeded draw for that output
position is made, exactly the draw plain decoding makes there, and the walk follows the child holding it, else
emits it. Each emitted token is the target's draw, so this is lossless too; for drafts chosen deterministically
a child is followed with probability p(child), as under the rule above.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specserve.sampling.sampler import filtered_probs, sample
from specserve.core import SamplingParams
from specserve.speculative.tree import DraftTree


@dataclass(frozen=True)
class Verdict:
    accepted_nodes: list[int]  # tree nodes along the accepted path, root excluded, in order
    tokens: list[int]  # accepted draft tokens followed by the bonus token

    @property
    def num_accepted_drafts(self) -> int:
        return len(self.accepted_nodes)


def verify(
    target_logits: torch.Tensor,  # [N, V]: row i is the target's logits for the token after tree node i
    tree: DraftTree,
    params: SamplingParams,
    generator: torch.Generator | None = None,
) -> Verdict:
    if params.greedy:
        return _verify_greedy(target_logits, tree)
    probs = filtered_probs(target_logits.float(), [params] * target_logits.shape[0])
    return _verify_sampled(probs, tree, generator)


def verify_seeded(target_logits: torch.Tensor, tree: DraftTree, params: SamplingParams, seeds: list[int]
                  ) -> Verdict:
    """`seeds[d]`: the seed of the draw at depth d (the output position root + d + 1); one per tree level and
    one more."""
    node, path, tokens = 0, [], []
    for seed in seeds:
        token = sample(target_logits[node:node + 1], [params], [seed]).item()
        tokens.append(token)
        follow = next((c for c in tree.children(node) if tree.tokens[c] == token), None)
        if follow is None:
            break
        path.append(follow)
        node = follow
    return Verdict(path, tokens)


def _verify_greedy(logits: torch.Tensor, tree: DraftTree) -> Verdict:
    best = logits.argmax(dim=-1).tolist()
    node, path, tokens = 0, [], []
    while True:
        follow = next((c for c in tree.children(node) if tree.tokens[c] == best[node]), None)
        tokens.append(best[node])
        if follow is None:
            return Verdict(path, tokens)
        path.append(follow)
        node = follow


def _verify_sampled(probs: torch.Tensor, tree: DraftTree, generator: torch.Generator | None) -> Verdict:
    node, path, tokens = 0, [], []
    while True:
        residual = probs[node].clone()
        accepted = None
        for child in tree.children(node):
            token = tree.tokens[child]
            mass = residual.sum()
            if mass <= 0:
                break
            if torch.rand((), generator=generator, device=residual.device) * mass < residual[token]:
                accepted = child
                break
            residual[token] = 0.0
        if accepted is None:
            bonus = torch.multinomial(residual / residual.sum(), 1, generator=generator).item()
            tokens.append(bonus)
            return Verdict(path, tokens)
        path.append(accepted)
        tokens.append(tree.tokens[accepted])
        node = accepted
