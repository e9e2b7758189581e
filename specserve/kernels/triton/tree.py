"""The tree program's bookkeeping in Triton: between the head's passes one kernel a level, the selection of the tree
in one, and a greedy step's acceptance in one.

In PyTorch (`TreeGraphs._search`, `_select`, `_leaf` and `_emit`: the CPU path and the reference), each level of
the search makes its children's scores and target ids, sorts them to feed the k best to the next level and
gathers their states, tokens and paths (~17 small kernels); keeping the N best candidates and laying them out as a
tree (ranks, node numbers, parents, paths) takes ~35 more, and accepting a greedy step ~40. In a batch-1 graph
each pays a launch's latency, however little it does. Here one program per sequence does a level, one the
selection, and one the acceptance. Rankings compare every pair of candidates, so ties keep the earlier
candidate, as a stable sort does.

Three more kernels take what was left of the step's small PyTorch operations: the row inputs that follow from
the step's positions (`step_rows`, ~8 operations), the search's first level (`root_children`, ~5) and the move
of the accepted nodes' KV and taps (`move_slots`, 4). SPECSERVE_FUSED_SEARCH=0 runs the PyTorch forms on a GPU.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from specserve.kernels.triton.follow import copy_table_rows

# The rankings compare every pair of candidates in one program: searches with more candidates than this keep the
# PyTorch form (the top-4, 5-level tree has 68).
MAX_CANDIDATES = 256
# Warps of the selection kernel: timed alone, 8 edged out 4 (in the tree step the two tie).
SELECT_WARPS = 8


@triton.jit
def _ranks(score, index, valid):
    """Each entry's place in (score descending, index ascending) order among the valid ones (NaN ranks as -inf,
    so the places are a permutation)."""
    score = tl.where(score != score, float("-inf"), score)
    tied_before = (score[None, :] == score[:, None]) & (index[None, :] < index[:, None])
    ahead = (score[None, :] > score[:, None]) | tied_before
    return tl.sum((ahead & valid[None, :]).to(tl.int32), axis=1)


@triton.jit
def _expand_kernel(VALUES, INDICES, D2T, FED_SCORES, FRONTIER, STATES, PATH, OWN,
                   CAND_TOKENS, CAND_SCORES, CAND_PARENTS, NEXT_TOKENS, NEXT_SCORES, NEXT_FRONTIER, NEXT_STATES,
                   NEXT_PATH, stride_fed, stride_frontier, stride_cand, stride_own, column, hidden,
                   K: tl.constexpr, KK_PAD: tl.constexpr, K_PAD: tl.constexpr, LEVEL: tl.constexpr,
                   LAST: tl.constexpr, HAS_D2T: tl.constexpr, BLOCK_H: tl.constexpr):
    """One sequence, one level: its k fed rows' k best children (VALUES, INDICES [bs * k, k]) become candidates
    `column`.. (target id, cumulative score, parent candidate); unless LAST, the k best of them are fed next:
    their tokens, scores, candidate numbers (`column` + their place), the states of their parents' rows (STATES
    [bs * k, hidden]) and their paths (their parents' LEVEL head slots, then their own, OWN [bs, >= k])."""
    b = tl.program_id(0)
    j = tl.arange(0, KK_PAD)
    valid = j < K * K
    fed = j // K
    value = tl.load(VALUES + b * K * K + j, mask=valid, other=0.0)
    index = tl.load(INDICES + b * K * K + j, mask=valid, other=0)
    if HAS_D2T:
        index += tl.load(D2T + index, mask=valid, other=0)
    score = tl.load(FED_SCORES + b * stride_fed + fed, mask=valid, other=0.0) + value
    score = tl.where(valid, score, float("-inf"))
    parent = tl.load(FRONTIER + b * stride_frontier + fed, mask=valid, other=0)
    tl.store(CAND_TOKENS + b * stride_cand + column + j, index, mask=valid)
    tl.store(CAND_SCORES + b * stride_cand + column + j, score, mask=valid)
    tl.store(CAND_PARENTS + b * stride_cand + column + j, parent, mask=valid)
    if not LAST:
        rank = _ranks(score, j, valid)
        r = tl.arange(0, K_PAD)
        r_ok = r < K
        pick = (rank[None, :] == r[:, None]) & valid[None, :] & r_ok[:, None]  # [K_PAD, KK_PAD]: child of rank r
        order = tl.sum(tl.where(pick, j[None, :], 0), axis=1)
        tl.store(NEXT_TOKENS + b * K + r, tl.sum(tl.where(pick, index[None, :], 0), axis=1), mask=r_ok)
        tl.store(NEXT_SCORES + b * K + r, tl.sum(tl.where(pick, score[None, :], 0.0), axis=1), mask=r_ok)
        tl.store(NEXT_FRONTIER + b * K + r, column + order, mask=r_ok)
        src = (b * K + order // K).to(tl.int64)
        dst = (b * K + r).to(tl.int64)
        for h0 in range(0, hidden, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            ok = r_ok[:, None] & (h[None, :] < hidden)
            state = tl.load(STATES + src[:, None] * hidden + h[None, :], mask=ok)
            tl.store(NEXT_STATES + dst[:, None] * hidden + h[None, :], state, mask=ok)
        for d in tl.static_range(LEVEL):
            tl.store(NEXT_PATH + dst * (LEVEL + 1) + d, tl.load(PATH + src * LEVEL + d, mask=r_ok), mask=r_ok)
        tl.store(NEXT_PATH + dst * (LEVEL + 1) + LEVEL, tl.load(OWN + b * stride_own + r, mask=r_ok), mask=r_ok)


def expand_level(values, indices, d2t, fed_scores, frontier, states, path, own, candidates: dict, column: int,
                 level: int, last: bool, out: dict) -> None:
    """`_expand_kernel` over the batch. `path` [bs * k, level] and `states` [bs * k, hidden] contiguous;
    `fed_scores`, `frontier` [bs, k] with unit stride along k; `own` [bs, k..] the next level's own head slots.
    Writes `candidates` (tokens, scores, parents [bs, C]) and, unless `last`, `out` (tokens, scores, frontier
    [bs, k], states [bs * k, hidden], path [bs * k, level + 1])."""
    rows, k = values.shape
    bs = rows // k
    for t in (values, indices, states, path) + ((d2t,) if d2t is not None else ()):
        assert t.is_contiguous()
    assert fed_scores.stride(1) == 1 and frontier.stride(1) == 1 and own.stride(1) == 1
    assert all(t.stride(1) == 1 for t in candidates.values())
    if not last:
        assert all(out[name].is_contiguous() for name in ("tokens", "scores", "frontier", "states", "path"))
    hidden = states.shape[1]
    nxt = out if not last else {name: candidates["tokens"] for name in ("tokens", "scores", "frontier", "states",
                                                                       "path")}
    _expand_kernel[(bs,)](
        values, indices, d2t if d2t is not None else indices, fed_scores, frontier, states, path, own,
        candidates["tokens"], candidates["scores"], candidates["parents"], nxt["tokens"], nxt["scores"],
        nxt["frontier"], nxt["states"], nxt["path"], fed_scores.stride(0), frontier.stride(0),
        candidates["tokens"].stride(0), own.stride(0), column, hidden, K=k,
        KK_PAD=max(16, triton.next_power_of_2(k * k)), K_PAD=max(2, triton.next_power_of_2(k)), LEVEL=level,
        LAST=last, HAS_D2T=d2t is not None, BLOCK_H=1024,
    )


@triton.jit
def _select_kernel(TOKENS, PARENTS, SCORES, DEPTHS, LIMIT, ROOT_IDS, ROOT_SLOTS, SCRATCH, ROOT_POS,
                   OUT_TOKENS, OUT_PARENT, OUT_DEPTH, OUT_PATH, OUT_IN_TREE, OUT_SLOTS, OUT_TAILS, OUT_SEQ_LENS,
                   OUT_TAIL_LENS, OUT_POSITIONS, stride_cand, stride_scratch,
                   C: tl.constexpr, C_PAD: tl.constexpr, N: tl.constexpr, N1_PAD: tl.constexpr,
                   DEPTH: tl.constexpr, DEPTH_PAD: tl.constexpr):
    """One sequence: its N best candidates (score descending, the earlier first among equals), numbered 1..N in
    candidate order after the root (node 0), with their tokens, parent nodes, depths, paths (the ancestor at
    each depth, itself last, 0 past it), whether they rank within the sequence's limit, and their slots; and
    what the verify's row of each node reads (`TreeGraphs._verify_rows`)."""
    b = tl.program_id(0)
    i = tl.arange(0, C_PAD)
    valid = i < C
    cand = b * stride_cand + i
    score = tl.load(SCORES + cand, mask=valid, other=float("-inf"))
    rank = _ranks(score, i, valid)
    kept = valid & (rank < N)
    node = tl.cumsum(kept.to(tl.int32), axis=0)  # a kept candidate's number: 1 + the kept ones before it
    node_of = tl.where(kept, node, 0)
    parent_cand = tl.load(PARENTS + cand, mask=valid, other=-1)
    parent = tl.sum(tl.where(i[None, :] == parent_cand[:, None], node_of[None, :], 0), axis=1)
    depth = tl.load(DEPTHS + i, mask=valid, other=0)
    out = b * (N + 1) + node
    tl.store(OUT_TOKENS + out, tl.load(TOKENS + cand, mask=valid, other=0), mask=kept)
    tl.store(OUT_PARENT + out, parent.to(tl.int64), mask=kept)
    tl.store(OUT_DEPTH + out, depth, mask=kept)
    tl.store(OUT_IN_TREE + out, (rank < tl.load(LIMIT + b)).to(tl.int8), mask=kept)
    root = b * (N + 1)
    tl.store(OUT_TOKENS + root, tl.load(ROOT_IDS + b))
    tl.store(OUT_PARENT + root, 0)
    tl.store(OUT_DEPTH + root, 0)
    tl.store(OUT_IN_TREE + root, 1)
    s = tl.arange(0, N1_PAD)
    root_slot = tl.load(ROOT_SLOTS + b)
    scratch = tl.load(SCRATCH + b * stride_scratch + s - 1, mask=(s >= 1) & (s <= N), other=0)
    tl.store(OUT_SLOTS + root + s, tl.where(s == 0, root_slot, scratch), mask=s <= N)
    # Paths, among the N + 1 nodes rather than the C candidates: each node's parent and depth in node order,
    # then every node walks up at once, writing each ancestor at its depth.
    is_node = (node_of[None, :] == s[:, None]) & kept[None, :]  # [node, candidate]; the root has none
    node_parent = tl.sum(tl.where(is_node, parent[None, :], 0), axis=1)
    node_depth = tl.sum(tl.where(is_node, depth[None, :], 0), axis=1)
    d = tl.arange(0, DEPTH_PAD)
    path = tl.zeros([N1_PAD, DEPTH_PAD], dtype=tl.int64)
    ancestor = s
    for step in tl.static_range(DEPTH):
        at = node_depth - 1 - step
        path = tl.where(d[None, :] == at[:, None], ancestor[:, None].to(tl.int64), path)
        ancestor = tl.sum(tl.where(s[None, :] == ancestor[:, None], node_parent[None, :], 0), axis=1)
    rows = (root + s).to(tl.int64)
    in_path = (s[:, None] <= N) & (d[None, :] < DEPTH)
    tl.store(OUT_PATH + rows[:, None] * DEPTH + d[None, :], path, mask=in_path)
    # The verify's rows: each node's tail (its path's slots; node 0's is the root's), context length (the
    # root's position + 1), tail length and position.
    tail = tl.load(SCRATCH + b * stride_scratch + path - 1, mask=in_path & (path >= 1), other=0)
    tl.store(OUT_TAILS + rows[:, None] * DEPTH + d[None, :], tl.where(path >= 1, tail, root_slot), mask=in_path)
    root_pos = tl.load(ROOT_POS + b)
    on = s <= N
    tl.store(OUT_SEQ_LENS + rows, (root_pos + 1 + 0 * s).to(tl.int32), mask=on)
    tl.store(OUT_TAIL_LENS + rows, node_depth.to(tl.int32), mask=on)
    tl.store(OUT_POSITIONS + rows, root_pos + node_depth, mask=on)


def select_nodes(candidates: dict, candidate_depth: torch.Tensor, limit: torch.Tensor, root_ids: torch.Tensor,
                 root_slots: torch.Tensor, scratch: torch.Tensor, depth: int, root_pos: torch.Tensor) -> dict:
    """`TreeGraphs._select` in one kernel: candidates (tokens, parents [bs, C] int64, scores [bs, C] fp32) ->
    the nodes dict (tokens, parent, depth, path, in_tree, slots), with the verify's rows
    (`TreeGraphs._verify_rows`, from the roots' positions) under "verify_rows": their launches off a step."""
    tokens = candidates["tokens"]
    bs, c = tokens.shape
    n = scratch.shape[1]
    long = dict(dtype=torch.long, device=tokens.device)
    nodes = {"tokens": torch.empty(bs, n + 1, **long), "parent": torch.empty(bs, n + 1, **long),
             "depth": torch.empty(bs, n + 1, **long), "path": torch.empty(bs, n + 1, depth, **long),
             "in_tree": torch.empty(bs, n + 1, dtype=torch.bool, device=tokens.device),
             "slots": torch.empty(bs, n + 1, **long)}
    int32 = dict(dtype=torch.int32, device=tokens.device)
    rows = {"tails": torch.empty(bs * (n + 1), depth, **long), "seq_lens": torch.empty(bs * (n + 1), **int32),
            "tail_lens": torch.empty(bs * (n + 1), **int32), "positions": torch.empty(bs * (n + 1), **long)}
    assert root_pos.is_contiguous() and root_slots.is_contiguous()
    assert tokens.stride(1) == 1 and candidates["parents"].stride() == tokens.stride()
    assert candidates["scores"].stride() == tokens.stride() and scratch.stride(1) == 1
    _select_kernel[(bs,)](
        tokens, candidates["parents"], candidates["scores"], candidate_depth, limit, root_ids, root_slots, scratch,
        root_pos, nodes["tokens"], nodes["parent"], nodes["depth"], nodes["path"], nodes["in_tree"].view(torch.int8),
        nodes["slots"], rows["tails"], rows["seq_lens"], rows["tail_lens"], rows["positions"], tokens.stride(0),
        scratch.stride(0), C=c, C_PAD=triton.next_power_of_2(c), N=n,
        N1_PAD=triton.next_power_of_2(n + 1), DEPTH=depth, DEPTH_PAD=max(2, triton.next_power_of_2(depth)),
        num_warps=SELECT_WARPS,
    )
    return nodes | {"verify_rows": rows}


@triton.jit
def _accept_kernel(TOKENS, PARENT, DEPTHS, PATH, IN_TREE, SLOTS, BEST, FORCED, REAL_SLOTS, ROOTS, PACKED,
                   LAST_PACKED, LAST_ROOT, SRC, DST, pad_slot, stride_real, stride_last, N1: tl.constexpr,
                   N1_PAD: tl.constexpr, DEPTH: tl.constexpr, W_PAD: tl.constexpr, FORCE: tl.constexpr):
    """One sequence of a greedy tree step: the accepted node (the deepest whose path the target chose all the
    way; with FORCE, simulated: FORCED levels down each node's first child among those whose subtree gets
    there), its path's tokens with the target's own after them and the count, packed; and the slots its nodes'
    KV and taps move from and to."""
    b = tl.program_id(0)
    i = tl.arange(0, N1_PAD)
    ok = i < N1
    row = b * N1
    token = tl.load(TOKENS + row + i, mask=ok, other=0)
    parent = tl.load(PARENT + row + i, mask=ok, other=0)
    depth = tl.load(DEPTHS + row + i, mask=ok, other=0)
    in_tree = (tl.load(IN_TREE + row + i, mask=ok, other=0) != 0) & ok
    best = tl.load(BEST + row + i, mask=ok, other=0)
    is_parent = i[None, :] == parent[:, None]  # [node, its parent]
    if FORCE:
        is_child = (parent[None, :] == i[:, None]) & in_tree[None, :] & (i[None, :] > 0)  # [node, its child]
        deepest = tl.where(in_tree, depth, -1)  # the depth of each node's deepest descendant in the tree
        for _ in tl.static_range(DEPTH):
            deepest = tl.maximum(deepest, tl.max(tl.where(is_child, deepest[None, :], -1), axis=1))
        target = tl.minimum(tl.load(FORCED + b), tl.max(tl.where(i == 0, deepest, -1), axis=0))
        reaches = is_child & (deepest[None, :] >= target)
        first_child = tl.min(tl.where(reaches, i[None, :], N1), axis=1)
        leaf = target * 0
        for d in tl.static_range(DEPTH):
            child = tl.sum(tl.where(i == leaf, first_child, 0), axis=0)
            leaf = tl.where((child < N1) & (d < target), child, leaf)
    else:
        matches = (token == tl.sum(tl.where(is_parent, best[None, :], 0), axis=1)) | (i == 0)
        reachable = matches
        for _ in tl.static_range(DEPTH):
            reachable = matches & (tl.sum(tl.where(is_parent, reachable[None, :].to(tl.int32), 0), axis=1) > 0)
        score = tl.where(reachable & in_tree, depth + 1, 0)
        leaf = tl.min(tl.where(score == tl.max(score, axis=0), i, N1_PAD), axis=0)
    after = tl.sum(tl.where(i == leaf, best, 0), axis=0)
    accepted = tl.sum(tl.where(i == leaf, depth, 0), axis=0)
    d = tl.arange(0, W_PAD)
    on_path = d < DEPTH
    path = tl.load(PATH + (row + leaf) * DEPTH + d, mask=on_path, other=0)
    path_tokens = tl.sum(tl.where(i[None, :] == path[:, None], token[None, :], 0), axis=1)
    packed = tl.where(on_path, path_tokens, 0)
    packed = tl.where(d == accepted, after, packed)
    packed = tl.where(d == DEPTH + 1, accepted, packed)
    tl.store(PACKED + b * (DEPTH + 2) + d, packed, mask=d < DEPTH + 2)
    tl.store(LAST_PACKED + b * stride_last + d, packed, mask=d < DEPTH + 2)
    tl.store(LAST_ROOT + b, tl.load(ROOTS + b))
    keep = on_path & (d < accepted)
    src = tl.load(SLOTS + row + path, mask=keep, other=pad_slot)
    dst = tl.load(REAL_SLOTS + b * stride_real + d, mask=keep, other=pad_slot)
    tl.store(SRC + b * DEPTH + d, src, mask=on_path)
    tl.store(DST + b * DEPTH + d, dst, mask=on_path)


def accept_tree(nodes: dict, best: torch.Tensor, forced: torch.Tensor | None, real_slots: torch.Tensor,
                pad_slot: int, roots: torch.Tensor, last_packed: torch.Tensor, last_root: torch.Tensor):
    """A greedy tree step's `_leaf`, `_emit` and `pack_tokens` (TreeGraphs), in one kernel: -> (packed [bs, depth + 2],
    the slots the accepted nodes' KV and taps move from and to [bs, depth], the padding slot past them). Also
    copies packed to last_packed[:bs] and roots [bs] to last_root[:bs]."""
    tokens = nodes["tokens"]
    bs, width = tokens.shape
    depth = nodes["path"].shape[2]
    for t in (tokens, nodes["parent"], nodes["depth"], nodes["path"], nodes["in_tree"], nodes["slots"], best):
        assert t.is_contiguous()
    assert real_slots.stride(1) == 1 and last_packed.stride(1) == 1 and roots.is_contiguous()
    assert last_root.is_contiguous() and (forced is None or forced.is_contiguous())
    long = dict(dtype=torch.long, device=tokens.device)
    packed = torch.empty(bs, depth + 2, **long)
    src, dst = torch.empty(bs, depth, **long), torch.empty(bs, depth, **long)
    _accept_kernel[(bs,)](
        tokens, nodes["parent"], nodes["depth"], nodes["path"], nodes["in_tree"].view(torch.int8), nodes["slots"],
        best, forced if forced is not None else roots, real_slots, roots, packed, last_packed, last_root, src, dst,
        pad_slot, real_slots.stride(0), last_packed.stride(0), N1=width, N1_PAD=triton.next_power_of_2(width),
        DEPTH=depth, W_PAD=triton.next_power_of_2(depth + 2), FORCE=forced is not None,
    )
    return packed, src, dst


@triton.jit
def _step_rows_kernel(CATCH_POS, ROOT_POS, TABLE, CATCH_LENS, CATCH_TABLES, FED_POS, FED_LENS, FED_TABLES,
                      VERIFY_TABLES, stride_table, stride_catch_table, stride_fed_table, stride_verify_table,
                      stride_level, pages, W: tl.constexpr, W_PAD: tl.constexpr, K: tl.constexpr,
                      K_PAD: tl.constexpr, LEVELS: tl.constexpr, N1: tl.constexpr, N1_PAD: tl.constexpr,
                      PAGE_BLOCK: tl.constexpr):
    """Sequence b's attention inputs of a tree step that follow from its positions: see step_rows."""
    b = tl.program_id(0)
    j = tl.arange(0, W_PAD)
    pos = tl.load(CATCH_POS + b * W + j, mask=j < W, other=0)
    tl.store(CATCH_LENS + b * W + j, (pos + 1).to(tl.int32), mask=j < W)
    root = tl.load(ROOT_POS + b)
    r = tl.arange(0, K_PAD)
    tl.store(FED_LENS + b * K + r, (root + 0 * r).to(tl.int32), mask=r < K)
    for level in tl.static_range(LEVELS):
        tl.store(FED_POS + level * stride_level + b * K + r, root + level + 0 * r, mask=r < K)
    copy_table_rows(TABLE, CATCH_TABLES, stride_table, stride_catch_table, b, pages, W, W_PAD, PAGE_BLOCK)
    copy_table_rows(TABLE, FED_TABLES, stride_table, stride_fed_table, b, pages, K, K_PAD, PAGE_BLOCK)
    copy_table_rows(TABLE, VERIFY_TABLES, stride_table, stride_verify_table, b, pages, N1, N1_PAD, PAGE_BLOCK)


def step_rows(catch_pos: torch.Tensor, root_pos: torch.Tensor, table: torch.Tensor, out: dict) -> None:
    """`TreeGraphs._step_rows` in one kernel: from the catch-up rows' positions [bs, W], the roots' [bs] and the
    page tables [bs, pages] int32, writes `out`'s catch_lens [bs * W] int32, catch_tables [bs * W, pages],
    fed_pos [levels, bs * k] (level l's rows at root + l), fed_lens [bs * k] int32 (the roots), fed_tables
    [bs * k, pages] and verify_tables [bs * (N + 1), pages]."""
    bs, w = catch_pos.shape
    k = out["fed_lens"].shape[0] // bs
    n1 = out["verify_tables"].shape[0] // bs
    assert catch_pos.is_contiguous() and root_pos.is_contiguous() and table.stride(1) == 1
    assert out["catch_lens"].is_contiguous() and out["fed_lens"].is_contiguous() and out["fed_pos"].stride(1) == 1
    tables = [out[name] for name in ("catch_tables", "fed_tables", "verify_tables")]
    assert all(t.stride(1) == 1 and t.shape[1] == table.shape[1] for t in tables)
    _step_rows_kernel[(bs,)](
        catch_pos, root_pos, table, out["catch_lens"], out["catch_tables"], out["fed_pos"], out["fed_lens"],
        out["fed_tables"], out["verify_tables"], table.stride(0),
        *(t.stride(0) for t in tables), out["fed_pos"].stride(0), table.shape[1], W=w,
        W_PAD=triton.next_power_of_2(w), K=k, K_PAD=max(2, triton.next_power_of_2(k)), LEVELS=out["fed_pos"].shape[0],
        N1=n1, N1_PAD=triton.next_power_of_2(n1), PAGE_BLOCK=64,
    )


@triton.jit
def _root_children_kernel(VALUES, INDICES, D2T, STATE, CAND_TOKENS, CAND_SCORES, FED_TOKENS, FED_SCORES,
                          FED_STATES, stride_values, stride_state, stride_cand, hidden, K: tl.constexpr,
                          K_PAD: tl.constexpr, HAS_D2T: tl.constexpr, BLOCK_H: tl.constexpr):
    """One sequence: the root's k best children as candidates 0..k-1 and as the first level's fed rows."""
    b = tl.program_id(0)
    r = tl.arange(0, K_PAD)
    ok = r < K
    value = tl.load(VALUES + b * stride_values + r, mask=ok, other=0.0)
    index = tl.load(INDICES + b * stride_values + r, mask=ok, other=0)
    if HAS_D2T:
        index += tl.load(D2T + index, mask=ok, other=0)
    tl.store(CAND_TOKENS + b * stride_cand + r, index, mask=ok)
    tl.store(CAND_SCORES + b * stride_cand + r, value, mask=ok)
    tl.store(FED_TOKENS + b * K + r, index, mask=ok)
    tl.store(FED_SCORES + b * K + r, value, mask=ok)
    rows = (b * K + r).to(tl.int64)
    for h0 in range(0, hidden, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        state = tl.load(STATE + b * stride_state + h, mask=h < hidden)
        tl.store(FED_STATES + rows[:, None] * hidden + h[None, :], tl.broadcast_to(state[None, :], (K_PAD, BLOCK_H)),
                 mask=ok[:, None] & (h < hidden)[None, :])


def root_children(values: torch.Tensor, indices: torch.Tensor, d2t, state: torch.Tensor, candidates: dict,
                  fed: dict) -> None:
    """The search's first level in one kernel: the root's children (log-probs and draft ids [bs, k], best first;
    `d2t` maps draft ids to the target's, or None) become candidates 0..k-1 (tokens, scores), and are fed next,
    in that order: `fed`'s tokens and scores [bs, k], and the root's state [bs, H] once per child ([bs * k, H])."""
    bs, k = values.shape
    assert values.stride() == indices.stride() and values.stride(1) == 1 and state.stride(1) == 1
    assert candidates["tokens"].stride() == candidates["scores"].stride() and candidates["tokens"].stride(1) == 1
    assert all(fed[name].is_contiguous() for name in ("tokens", "scores", "states"))
    _root_children_kernel[(bs,)](
        values, indices, d2t if d2t is not None else indices, state, candidates["tokens"], candidates["scores"],
        fed["tokens"], fed["scores"], fed["states"], values.stride(0), state.stride(0),
        candidates["tokens"].stride(0), state.shape[1], K=k, K_PAD=max(2, triton.next_power_of_2(k)),
        HAS_D2T=d2t is not None, BLOCK_H=1024,
    )


@triton.jit
def _move_kernel(KV, TAPS, SRC, DST, pad_slot, stride_plane, row, taps_row, PLANES: tl.constexpr,
                 BLOCK: tl.constexpr):
    """One (source, destination) pair and one plane of the KV (a layer's keys or values), or the taps (the plane
    past the last): the source slot's row copied to the destination's. Pairs from the padding slot move nothing."""
    pair = tl.program_id(0)
    plane = tl.program_id(1)
    src = tl.load(SRC + pair)
    if src != pad_slot:
        dst = tl.load(DST + pair)
        if plane < PLANES:
            base, width = KV + plane.to(tl.int64) * stride_plane, row
        else:
            base, width = TAPS, taps_row
        for e0 in range(0, width, BLOCK):
            e = e0 + tl.arange(0, BLOCK)
            values = tl.load(base + src * width + e, mask=e < width)
            tl.store(base + dst * width + e, values, mask=e < width)


def move_slots(kv_cache: torch.Tensor, taps: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, pad_slot: int
               ) -> None:
    """TreeGraphs._move_slots in one kernel: kv_cache [L, 2, slots, ...] and taps [slots, H] at slots src [P]
    copied to dst [P], pairs whose source is the padding slot left out (the PyTorch form copies the padding slot
    onto itself there). Sources and destinations must be apart."""
    assert kv_cache.is_contiguous() and taps.is_contiguous() and src.is_contiguous() and dst.is_contiguous()
    assert kv_cache.dtype == taps.dtype  # one kernel copies both
    planes = kv_cache.shape[0] * kv_cache.shape[1]
    row = kv_cache[0, 0, 0].numel()
    _move_kernel[(src.numel(), planes + 1)](
        kv_cache, taps, src, dst, pad_slot, kv_cache.stride(1), row, taps.shape[1], PLANES=planes,
        BLOCK=min(4096, triton.next_power_of_2(max(row, taps.shape[1]))),
    )
