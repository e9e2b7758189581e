"""Acceptance on the device, without host branching: the rules of speculative/verify.py (the reference, with the
proof that they keep the target's distribution) for a chain's rows and a tree's nodes, batched."""
from __future__ import annotations

import torch

from specserve.sampling.sampler import race


def accept_chain(drafts: torch.Tensor, best: torch.Tensor, forced: torch.Tensor | None = None,
                 limit: torch.Tensor | None = None):
    """drafts [B, k], the target's choices best [B, k + 1] -> (tokens [B, k + 1], accepted drafts [B]).

    Row b's new tokens are tokens[b, :accepted[b] + 1]: the accepted drafts, then the target's own next
    token. `forced` replaces the greedy count (simulated acceptance); `limit` [B] caps it (a sequence
    scheduled with fewer than k drafts)."""
    k = drafts.shape[1]
    accepted = (drafts == best[:, :k]).int().cumprod(dim=1).sum(dim=1) if forced is None else forced
    if limit is not None:
        accepted = torch.minimum(accepted, limit)
    tokens = torch.cat([drafts, torch.zeros_like(drafts[:, :1])], dim=1)
    tokens.scatter_(1, accepted[:, None], best.gather(1, accepted[:, None]))
    return tokens, accepted


def accept_chain_sampled(drafts: torch.Tensor, probs: torch.Tensor, forced: torch.Tensor | None = None,
                         limit: torch.Tensor | None = None):
    """drafts [B, k], probs [B, k + 1, V] (the target's filtered distribution after root + each draft) ->
    (tokens [B, k + 1], accepted drafts [B]), as `accept_chain` packs them.

    speculative/verify.py's rule for a chain, on the device with no host branching: draft i + 1 is accepted with
    probability p_i(draft), and the first rejection ends the chain; the last token is drawn from p_n with the
    rejected draft's mass removed (from p_n itself when every scheduled draft was accepted), by the
    exponential race. Each emitted token is thereby distributed as the target's own draw."""
    k, vocab = drafts.shape[1], probs.shape[2]
    limit = torch.full_like(drafts[:, 0], k) if limit is None else limit
    draft_probs = probs[:, :k].gather(2, drafts[:, :, None])[:, :, 0]
    if forced is None:
        accepted = (torch.rand_like(draft_probs) < draft_probs).int().cumprod(dim=1).sum(dim=1)
    else:
        accepted = forced
    accepted = torch.minimum(accepted, limit)
    rest = probs.gather(1, accepted[:, None, None].expand(-1, 1, vocab))[:, 0]
    rejected = drafts.gather(1, accepted.clamp(max=k - 1)[:, None])
    removed = torch.where((accepted < limit)[:, None], 0.0, rest.gather(1, rejected))
    left = rest.scatter(1, rejected, removed)
    # A forced rejection (simulated acceptance) of a draft that held all the mass leaves nothing: keep p_n.
    rest = torch.where(left.sum(dim=1, keepdim=True) > 0, left, rest)
    tokens = torch.cat([drafts, torch.zeros_like(drafts[:, :1])], dim=1)
    tokens.scatter_(1, accepted[:, None], race(rest)[:, None])
    return tokens, accepted


def accept_tree_sampled(nodes: dict, dist, depth: int, max_children: int):
    """Nodes as `TreeGraphs._select` makes them (tokens, parent, in_tree: [B, N + 1], node 0 the root) and
    `dist`, which maps a node per row [B] to the target's filtered distribution after it [B, V] -> (the
    accepted node [B], the token after it [B]).

    speculative/verify.py's walk, with no host branching: at node c, with r = p_c, its children in node order are
    tried in turn, child x accepted with probability r(x) / sum(r), else r(x) = 0; an accepted child becomes c.
    Where none is accepted (or c is a leaf) the last token is drawn from r by the exponential race. Fixed loops:
    `depth` levels, `max_children` children a node. Distributions are computed for the nodes the walk reaches
    only (one [B, V] a level), not for every node of the tree."""
    tokens, parent, in_tree = nodes["tokens"], nodes["parent"], nodes["in_tree"]
    bs, width = tokens.shape
    device = tokens.device
    is_child_slot = torch.arange(width, device=device)[None, :] > 0
    node = torch.zeros(bs, dtype=torch.long, device=device)
    done = torch.zeros(bs, dtype=torch.bool, device=device)
    here = rest = dist(node)  # p at each row's node, and what is left of it
    for _ in range(depth):
        children = (parent == node[:, None]) & in_tree & is_child_slot
        sibling_rank = children.cumsum(dim=1) - 1
        moved = torch.zeros_like(done)
        for m in range(max_children):
            is_m = children & (sibling_rank == m)
            trying = is_m.any(dim=1) & ~done & ~moved
            child = is_m.int().argmax(dim=1)
            token = tokens.gather(1, child[:, None])
            mass = rest.gather(1, token)[:, 0]
            take = trying & (torch.rand(bs, device=device) * rest.sum(dim=1) < mass)
            rest = rest.scatter(1, token, torch.where((trying & ~take)[:, None], 0.0, mass[:, None]))
            node = torch.where(take, child, node)
            moved |= take
        done |= ~moved
        reached = dist(node)
        here = torch.where(moved[:, None], reached, here)
        rest = torch.where(moved[:, None], reached, rest)
    # Rounding can leave no mass after a rejection only where the rejected children held it all: keep p_c.
    return node, race(torch.where(rest.sum(dim=1, keepdim=True) > 0, rest, here))
