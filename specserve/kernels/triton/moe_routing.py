"""The small steps around the expert GEMMs of kernels/triton/fused_moe.py, one launch each: softmax top-k
routing, DeepSeek-V3's grouped sigmoid top-k, laying token-expert pairs out by expert, and the weighted sum of
each token's expert outputs. The softmax routing of one token (`softmax_topk_row`) is also what
kernels/triton/moe_decode.py's programs route with.

In PyTorch these are a dozen tiny ops a layer (sort, scan, search, index, fill, ...). At decode sizes each op
costs a launch's worth of device time, and together they cost more than reading the touched experts' weights.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_PAIRS = 4096  # token-expert pairs the one-launch layout takes; above, the PyTorch form


@triton.jit
def softmax_topk_row(LOGITS, E: tl.constexpr, E_POW2: tl.constexpr, K: tl.constexpr, K_POW2: tl.constexpr,
                     RENORMALIZE: tl.constexpr):
    """One token's routing: softmax over its E router logits in fp32, then the K largest, largest first, ties
    to the lower id; renormalised to sum to one where RENORMALIZE. Returns (weights, ids), [K_POW2] each, the
    slots past K zero. An id stays below E even for a row of NaN logits, which no pair may follow out."""
    experts = tl.arange(0, E_POW2)
    logits = tl.load(LOGITS + experts, mask=experts < E, other=-float("inf")).to(tl.float32)
    probs = tl.exp(logits - tl.max(logits, axis=0))
    probs = probs / tl.sum(probs, axis=0)
    slots = tl.arange(0, K_POW2)
    weights = tl.zeros([K_POW2], tl.float32)
    ids = tl.zeros([K_POW2], tl.int64)
    for j in tl.static_range(K):
        best = tl.argmax(probs, axis=0)
        weights = tl.where(slots == j, tl.max(probs, axis=0), weights)
        ids = tl.where(slots == j, tl.minimum(best, E - 1).to(tl.int64), ids)
        probs = tl.where(experts == best, -1.0, probs)
    if RENORMALIZE:
        weights = weights / tl.sum(weights, axis=0)
    return weights, ids


@triton.jit
def _softmax_topk_kernel(LOGITS, WEIGHTS, IDS, stride_l, E: tl.constexpr, E_POW2: tl.constexpr, K: tl.constexpr,
                         RENORMALIZE: tl.constexpr):
    """One token's `softmax_topk_row`, stored."""
    token = tl.program_id(0)
    weights, ids = softmax_topk_row(LOGITS + token * stride_l, E, E_POW2, K, K, RENORMALIZE)
    slots = tl.arange(0, K)
    tl.store(WEIGHTS + token * K + slots, weights)
    tl.store(IDS + token * K + slots, ids)


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """layers/moe.softmax_topk in one launch: (weights [T, k] fp32, expert ids [T, k] int64). Ties between equal
    probabilities go to the lower expert id."""
    tokens, experts = router_logits.shape
    assert router_logits.stride(-1) == 1 and top_k & (top_k - 1) == 0, "k must be a power of two"
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if tokens:
        _softmax_topk_kernel[(tokens,)](router_logits, weights, ids, router_logits.stride(0), E=experts,
                                        E_POW2=triton.next_power_of_2(experts), K=top_k, RENORMALIZE=renormalize)
    return weights, ids


@triton.jit
def _grouped_topk_kernel(LOGITS, BIAS, WEIGHTS, IDS, stride_l, scale, PER_GROUP: tl.constexpr,
                         N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, K: tl.constexpr, K_POW2: tl.constexpr,
                         G_POW2: tl.constexpr, PER_POW2: tl.constexpr, RENORMALIZE: tl.constexpr):
    """One token: sigmoid scores of its router logits, held [group, expert in group]; the biased scores choose
    the TOPK_GROUP groups whose two best sum highest, then the K best experts in those, largest first; weights
    are the unbiased scores, renormalised and scaled."""
    token = tl.program_id(0)
    groups = tl.arange(0, G_POW2)
    within = tl.arange(0, PER_POW2)
    experts = groups[:, None] * PER_GROUP + within[None, :]
    ok = (groups[:, None] < N_GROUP) & (within[None, :] < PER_GROUP)
    logits = tl.load(LOGITS + token * stride_l + experts, mask=ok, other=0.0).to(tl.float32)
    scores = 1.0 / (1.0 + tl.exp(-logits))
    biased = tl.where(ok, scores + tl.load(BIAS + experts, mask=ok, other=0.0), -float("inf"))
    if TOPK_GROUP < N_GROUP:
        best = tl.argmax(biased, axis=1)
        second = tl.max(tl.where(within[None, :] == best[:, None], -float("inf"), biased), axis=1)
        group_scores = tl.where(groups < N_GROUP, tl.max(biased, axis=1) + second, -float("inf"))
        allowed = groups < 0
        for _ in tl.static_range(TOPK_GROUP):
            chosen = tl.argmax(group_scores, axis=0)
            allowed = allowed | (groups == chosen)
            group_scores = tl.where(groups == chosen, -float("inf"), group_scores)
        biased = tl.where(allowed[:, None], biased, -float("inf"))
    slots = tl.arange(0, K_POW2)
    weights = tl.zeros([K_POW2], tl.float32)
    ids = tl.zeros([K_POW2], tl.int64)
    for j in tl.static_range(K):
        group = tl.argmax(tl.max(biased, axis=1), axis=0)
        member = tl.argmax(tl.max(tl.where(groups[:, None] == group, biased, -float("inf")), axis=0), axis=0)
        expert = group * PER_GROUP + member
        weight = tl.sum(tl.sum(tl.where(ok & (experts == expert), scores, 0.0), axis=1), axis=0)  # not a pad's
        weights = tl.where(slots == j, weight, weights)
        ids = tl.where(slots == j, expert.to(tl.int64), ids)
        biased = tl.where(experts == expert, -float("inf"), biased)
    if RENORMALIZE:
        weights = weights / (tl.sum(weights, axis=0) + 1e-20)
    tl.store(WEIGHTS + token * K + slots, weights * scale, mask=slots < K)
    tl.store(IDS + token * K + slots, ids, mask=slots < K)


def grouped_topk(router_logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                 renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """kernels/moe.grouped_topk in one launch, from the router's logits [T, E] (before the sigmoid): (weights
    [T, k] fp32, expert ids [T, k] int64), largest biased score first."""
    tokens, experts = router_logits.shape
    assert router_logits.stride(-1) == 1 and experts % n_group == 0
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=router_logits.device)
    per_group = experts // n_group
    if tokens:
        _grouped_topk_kernel[(tokens,)](router_logits, bias, weights, ids, router_logits.stride(0), scale,
                                        PER_GROUP=per_group, N_GROUP=n_group, TOPK_GROUP=topk_group, K=top_k,
                                        K_POW2=triton.next_power_of_2(top_k), G_POW2=triton.next_power_of_2(n_group),
                                        PER_POW2=triton.next_power_of_2(per_group), RENORMALIZE=renormalize)
    return weights, ids


@triton.jit
def _align_kernel(IDS, SLOT_PAIRS, BLOCK_EXPERT, SCRATCH, NUM_PAIRS, NUM_BLOCKS, NUM_SLOTS, E: tl.constexpr,
                  E_POW2: tl.constexpr, BLOCK_M: tl.constexpr, PAIRS: tl.constexpr, SLOTS: tl.constexpr,
                  BLOCKS: tl.constexpr):
    """One program lays every pair out (see `align`); PAIRS, SLOTS and BLOCKS are powers of two at least the
    counts. SCRATCH [3, E_POW2] int32: per-expert counts, the cursor each expert's next pair takes, and each
    expert's first slot. Phases are separated by block-wide barriers, so each reads what the whole program wrote
    before it."""
    experts = tl.arange(0, E_POW2)
    counts_at, cursor_at, starts_at = SCRATCH + experts, SCRATCH + E_POW2 + experts, SCRATCH + 2 * E_POW2 + experts
    tl.store(counts_at, tl.zeros([E_POW2], tl.int32))
    tl.store(cursor_at, tl.zeros([E_POW2], tl.int32))
    slots = tl.arange(0, SLOTS)
    tl.store(SLOT_PAIRS + slots, tl.zeros([SLOTS], tl.int64) + NUM_PAIRS, mask=slots < NUM_SLOTS)
    pairs = tl.arange(0, PAIRS)
    valid = pairs < NUM_PAIRS
    expert = tl.load(IDS + pairs, mask=valid, other=0).to(tl.int32)
    tl.debug_barrier()
    tl.atomic_add(SCRATCH + expert, 1, mask=valid)
    tl.debug_barrier()
    counts = tl.load(counts_at)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    tl.store(starts_at, ends - padded)
    ends = tl.where(experts < E, ends, 1 << 30)
    for b0 in tl.static_range(0, BLOCKS, 64):
        blocks = b0 + tl.arange(0, 64)
        # A block's expert is the number of experts whose run ends at or before the block's first slot.
        owner = tl.sum((ends[None, :] <= blocks[:, None] * BLOCK_M).to(tl.int32), axis=1)
        owner = tl.where(owner < E, owner, -1)
        tl.store(BLOCK_EXPERT + blocks, owner.to(tl.int64), mask=blocks < NUM_BLOCKS)
    tl.debug_barrier()
    rank = tl.atomic_add(SCRATCH + E_POW2 + expert, 1, mask=valid)
    slot = tl.load(SCRATCH + 2 * E_POW2 + expert, mask=valid, other=0) + rank
    tl.store(SLOT_PAIRS + slot, pairs.to(tl.int64), mask=valid)


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """fused_moe.align in one launch, with the same blocks and the same pairs in each, for up to `MAX_PAIRS`
    pairs (decode and verify steps; prefill chunks take the PyTorch form, whose launches their GEMMs outweigh).
    Within an expert the pairs' order is whichever the atomics give; every pair's output row is computed alone,
    so the order changes no result."""
    num_pairs, device = topk_ids.numel(), topk_ids.device
    if num_pairs > MAX_PAIRS:
        from specserve.kernels.triton.fused_moe import align as align_in_pytorch
        return align_in_pytorch(topk_ids, num_experts, block_m)
    num_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    slot_pairs = torch.empty(num_blocks * block_m, dtype=torch.int64, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int64, device=device)
    e_pow2 = triton.next_power_of_2(num_experts)
    scratch = torch.empty(3, e_pow2, dtype=torch.int32, device=device)
    _align_kernel[(1,)](topk_ids.reshape(-1), slot_pairs, block_expert, scratch, num_pairs, num_blocks,
                        num_blocks * block_m, E=num_experts, E_POW2=e_pow2, BLOCK_M=block_m,
                        PAIRS=max(16, triton.next_power_of_2(num_pairs)),
                        SLOTS=triton.next_power_of_2(num_blocks * block_m),
                        BLOCKS=max(64, triton.next_power_of_2(num_blocks)), num_warps=8)
    return slot_pairs, block_expert


@triton.jit
def _weighted_sum_kernel(PAIR_OUT, WEIGHTS, OUT, H, K: tl.constexpr, BLOCK: tl.constexpr):
    """One token's columns: the sum over its K pairs, in order, of weight * output, in fp32."""
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < H
    acc = tl.zeros([BLOCK], tl.float32)
    for j in tl.static_range(K):
        weight = tl.load(WEIGHTS + token * K + j).to(tl.float32)
        acc += weight * tl.load(PAIR_OUT + (token * K + j) * H + cols, mask=ok, other=0.0).to(tl.float32)
    tl.store(OUT + token * H + cols, acc.to(OUT.dtype.element_ty), mask=ok)


def weighted_sum(pair_out: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T*k, H] expert outputs in token-major pair order -> [T, H] in `dtype`, as kernels/moe._weighted_sum."""
    tokens, k = topk_weights.shape
    hidden = pair_out.shape[1]
    out = torch.empty(tokens, hidden, dtype=dtype, device=pair_out.device)
    block = 1024
    if tokens:
        _weighted_sum_kernel[(tokens, triton.cdiv(hidden, block))](pair_out.contiguous(), topk_weights.contiguous(),
                                                                   out, hidden, K=k, BLOCK=block)
    return out
