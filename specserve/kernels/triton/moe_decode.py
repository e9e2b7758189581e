"""Routed experts for the few rows of a decode step, as one GEMV per token-expert pair and one per token's sum.

At a handful of rows the grouped GEMMs of kernels/triton/fused_moe.py pay for work a GEMV does not need: the
pairs' layout by expert and the weighted sum are launches of their own, the rows are padded to the 16 a
tensor-core dot takes, and one token's few experts give too few programs to keep the memory system busy. Here
a step's MoE is two launches:

- `gate_up`: one program per (pair, tile of intermediate rows) streams its expert's gate and up rows against
  the token's row of x on CUDA cores and stores SiLU(gate) * up. With `router_logits` it also routes: each
  program takes the softmax top-k of its token's logits itself (the router's 128 logits cost little next to
  a weight tile), so routing needs no launch either; with `norm`, the block's RMSNorm of x is taken there too.
- `down_sum`: one program per (token, tile of output columns) runs the down projection of each of the token's
  k experts in turn and sums them, weighted, in fp32 in a fixed order; it can add the residual too.

An expert that two rows of a step chose is read twice (once per pair), so this form pays only while pairs
rarely share experts: decode at the smallest batches (kernels/moe.py chooses). Rounding follows the eager form
(kernels/moe.eager_fused_experts): each projection's output, SiLU(gate) and each expert's output in the
activation dtype; the weighting and sum in fp32.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from specserve.kernels.triton import pdl as triton_pdl
from specserve.kernels.triton.moe_routing import softmax_topk_row
from specserve.kernels.triton.pdl import gdc_launch_dependents, gdc_wait


class GemvTile(NamedTuple):
    """One GEMV's launch shape: output rows per program, reduction columns per iteration, warps."""
    block_n: int
    block_k: int
    warps: int


# (gate-up, down-sum): the fastest of benchmarks/fused_moe.py's sweep at one token on a Qwen3-30B-A3B layer, and
# within 2 % of it at four (benchmarks/results/fused_moe_qwen3_30b_a3b_h100.json).
DEFAULT_TILES = (GemvTile(32, 256, 4), GemvTile(8, 128, 8))


def tiles(text: str = "") -> tuple[GemvTile, GemvTile]:
    """(gate-up, down-sum) tiles from `block_n,block_k,warps;block_n,block_k,warps`; empty: the defaults."""
    if not text:
        return DEFAULT_TILES
    gate_up, down = (GemvTile(*map(int, part.split(","))) for part in text.split(";"))
    return gate_up, down


@triton.jit
def _gate_up_kernel(X, W13, ACT, IDS, WEIGHTS, LOGITS, GAMMA, stride_x, stride_we, stride_wn, stride_l, eps,
                    I: tl.constexpr, H: tl.constexpr, TOPK: tl.constexpr, TOPK_POW2: tl.constexpr,
                    E: tl.constexpr, E_POW2: tl.constexpr,
                    ROUTE: tl.constexpr, RENORMALIZE: tl.constexpr, NORM: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """ACT[pair, rows] = silu(x W_gate^T) * (x W_up^T) for the pair's token and expert. ROUTE: the expert (and
    its weight, stored by each pair's first program for `_down_sum_kernel`) from the token's router logits;
    else from IDS. NORM: x is first RMS-normalised (weight GAMMA), rounded where the norm kernel rounds."""
    pair = tl.program_id(0)
    token = pair // TOPK
    if PDL:
        gdc_wait()
    if ROUTE:
        weights, ids = softmax_topk_row(LOGITS + token * stride_l, E, E_POW2, TOPK, TOPK_POW2, RENORMALIZE)
        this_pair = tl.arange(0, TOPK_POW2) == pair % TOPK
        expert = tl.sum(tl.where(this_pair, ids, 0), axis=0)
        weight = tl.sum(tl.where(this_pair, weights, 0.0), axis=0)
        if tl.program_id(1) == 0:
            tl.store(IDS + pair, expert.to(tl.int64))
            tl.store(WEIGHTS + pair, weight)
    else:
        expert = tl.load(IDS + pair)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < I
    gate_rows = W13 + expert.to(tl.int64) * stride_we + rows.to(tl.int64)[:, None] * stride_wn
    up_rows = gate_rows + I * stride_wn
    dtype = ACT.dtype.element_ty
    if NORM:  # the token's row is a few KB, read from L2 by each of its programs
        squares = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            x = tl.load(X + token * stride_x + ks, mask=ks < H, other=0.0).to(tl.float32)
            squares += x * x
        scale = tl.rsqrt(tl.sum(squares, axis=0) / H + eps)
    acc_gate = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        x = tl.load(X + token * stride_x + ks, mask=k_ok, other=0.0).to(tl.float32)
        if NORM:
            gamma = tl.load(GAMMA + ks, mask=k_ok, other=0.0).to(tl.float32)
            x = (gamma * (x * scale).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x = x[None, :]
        w_mask = row_ok[:, None] & k_ok[None, :]
        acc_gate += tl.load(gate_rows + ks[None, :], mask=w_mask, other=0.0).to(tl.float32) * x
        acc_up += tl.load(up_rows + ks[None, :], mask=w_mask, other=0.0).to(tl.float32) * x
    if PDL:
        gdc_launch_dependents()
    gate = tl.sum(acc_gate, axis=1).to(dtype).to(tl.float32)
    up = tl.sum(acc_up, axis=1).to(dtype).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
    tl.store(ACT + pair * I + rows, act.to(dtype), mask=row_ok)


@triton.jit
def _down_sum_kernel(ACT, W2, OUT, IDS, WEIGHTS, RES, stride_we, stride_wn, stride_o, stride_r,
                     I: tl.constexpr, H: tl.constexpr, TOPK: tl.constexpr, ADD: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """OUT[token, cols] = sum over its pairs j, in order, of weight_j * (ACT[pair j] W2[expert j]^T)[cols]
    (+ RES[token, cols] where ADD)."""
    token = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    if PDL:
        gdc_wait()
    dtype = OUT.dtype.element_ty
    out = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOPK):
        pair = token * TOPK + j
        expert = tl.load(IDS + pair).to(tl.int64)
        w_rows = W2 + expert * stride_we + cols.to(tl.int64)[:, None] * stride_wn
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, I, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < I
            a = tl.load(ACT + pair * I + ks, mask=k_ok, other=0.0).to(tl.float32)[None, :]
            acc += tl.load(w_rows + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32) * a
        out += tl.load(WEIGHTS + pair).to(tl.float32) * tl.sum(acc, axis=1).to(dtype).to(tl.float32)
    if PDL:
        gdc_launch_dependents()
    if ADD:
        out = out.to(dtype).to(tl.float32) + tl.load(RES + token * stride_r + cols, mask=col_ok).to(tl.float32)
    tl.store(OUT + token * stride_o + cols, out.to(dtype), mask=col_ok)


def gate_up(x: torch.Tensor, w13: torch.Tensor, top_k: int, topk_ids: torch.Tensor | None = None,
            router_logits: torch.Tensor | None = None, renormalize: bool = False,
            norm: tuple[torch.Tensor, float] | None = None,
            tile: GemvTile = DEFAULT_TILES[0]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Each pair's SiLU(gate) * up, [T*k, I], for pairs given by `topk_ids` [T, k] or routed here from
    `router_logits` [T, E] (softmax top-k, `renormalize`d); of RMSNorm(x) with `norm` (its weight, eps).
    Returns (act, ids [T, k] int64, weights [T, k] fp32 or None where the ids were given)."""
    tokens, hidden = x.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    route = router_logits is not None
    if route:
        ids = torch.empty(tokens, top_k, dtype=torch.int64, device=x.device)
        weights = torch.empty(tokens, top_k, dtype=torch.float32, device=x.device)
        logits, stride_l = router_logits, router_logits.stride(0)
    else:
        ids, weights, logits, stride_l = topk_ids.contiguous(), None, topk_ids, 0
    act = x.new_empty(tokens * top_k, inter)
    if tokens:
        gamma, eps = norm if norm is not None else (x, 0.0)  # (unread without NORM)
        _gate_up_kernel[(tokens * top_k, triton.cdiv(inter, tile.block_n))](
            x, w13, act, ids, weights if route else ids, logits, gamma, x.stride(0), w13.stride(0), w13.stride(1),
            stride_l, eps, I=inter, H=hidden, TOPK=top_k, TOPK_POW2=triton.next_power_of_2(top_k), E=num_experts,
            E_POW2=triton.next_power_of_2(num_experts), ROUTE=route, RENORMALIZE=renormalize, NORM=norm is not None,
            BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, num_warps=tile.warps, **triton_pdl.launch_options(x))
    return act, ids, weights


def down_sum(act: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
             dtype: torch.dtype, add: torch.Tensor | None = None,
             tile: GemvTile = DEFAULT_TILES[1]) -> torch.Tensor:
    """[T*k, I] activations -> [T, H] in `dtype`: per token the weighted sum of its experts' down projections
    (+ `add` [T, H])."""
    tokens, top_k = topk_ids.shape
    _, hidden, inter = w2.shape
    out = act.new_empty(tokens, hidden, dtype=dtype)
    res = out if add is None else add
    if tokens:
        _down_sum_kernel[(tokens, triton.cdiv(hidden, tile.block_n))](
            act, w2, out, topk_ids.contiguous(), topk_weights.contiguous(), res, w2.stride(0), w2.stride(1),
            out.stride(0), res.stride(0), I=inter, H=hidden, TOPK=top_k, ADD=add is not None,
            BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, num_warps=tile.warps, **triton_pdl.launch_options(act))
    return out
