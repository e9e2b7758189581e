"""Routed experts as two grouped GEMMs over token-expert pairs sorted by expert (kernels/moe.py's
`eager_fused_experts` is the form they are held to).

The pairs are laid out in slots, each expert's run padded to whole blocks of rows, so one program owns a block
of one expert's rows and a tile of output columns: it streams that expert's weight tile once for all its
rows. A decode or verify step, where an expert gets a few rows, thus reads each touched expert's weights once.
Laying the pairs out (`align`) takes only tensor ops sized by the step's shape, with no host sync, so a step
that runs the kernels can be captured in a CUDA graph.

The first GEMM gathers each pair's token row of x and applies SiLU-and-multiply to its gate and up tiles in
registers; the second writes each pair's output back in pair order. The caller weighs and sums over k.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from specserve.kernels.triton import moe_routing


class Tile(NamedTuple):
    """One GEMM's launch shape: output columns and reduction depth per iteration, warps, pipeline stages."""
    block_n: int = 64
    block_k: int = 64
    warps: int = 4
    stages: int = 3


DEFAULT_TILES = (Tile(), Tile())  # (gate-up GEMM, down GEMM)


@triton.jit
def _expert_gemm_kernel(A, W, C, SLOT_PAIRS, BLOCK_EXPERT, NUM_PAIRS, stride_am, stride_we, stride_wn, stride_cm,
                        N: tl.constexpr, K: tl.constexpr, TOPK: tl.constexpr, GATHER_A: tl.constexpr,
                        SCATTER_C: tl.constexpr, GATED: tl.constexpr, PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[rows] = A[rows] @ W[expert, cols]^T for one block of slots; GATED: silu(A W_gate^T) * (A W_up^T), the up
    rows N further down W. Rows come from the pair in each slot: its token (GATHER_A) or the slot itself, and
    go to the pair (SCATTER_C) or the slot. Pad slots hold NUM_PAIRS and are neither read nor written."""
    block = tl.program_id(0)
    expert = tl.load(BLOCK_EXPERT + block)
    if expert >= 0:
        slots = block * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(SLOT_PAIRS + slots)
        valid = pairs < NUM_PAIRS
        if GATHER_A:
            a_rows = (pairs // TOPK).to(tl.int64)
        else:
            a_rows = slots.to(tl.int64)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < N
        weights = W + expert.to(tl.int64) * stride_we
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < K
            a = tl.load(A + a_rows[:, None] * stride_am + ks[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
            w_mask = k_ok[:, None] & col_ok[None, :]
            w = tl.load(weights + cols[None, :] * stride_wn + ks[:, None], mask=w_mask, other=0.0)  # [BK, BN]
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            if GATED:
                w_up = tl.load(weights + (cols[None, :] + N) * stride_wn + ks[:, None], mask=w_mask, other=0.0)
                acc_up = tl.dot(a, w_up, acc_up, input_precision=PRECISION)
        dtype = C.dtype.element_ty
        if GATED:
            # Rounded where the eager form rounds: each projection's output, then silu(gate), to the dtype.
            gate = acc.to(dtype).to(tl.float32)
            up = acc_up.to(dtype).to(tl.float32)
            out = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32) * up
        else:
            out = acc
        if SCATTER_C:
            c_rows = pairs.to(tl.int64)
        else:
            c_rows = slots.to(tl.int64)
        tl.store(C + c_rows[:, None] * stride_cm + cols[None, :], out.to(dtype), mask=valid[:, None] & col_ok[None, :])


def block_rows(num_pairs: int, num_experts: int) -> int:
    """Rows per block. 16 (the smallest tile tl.dot takes) while experts get few rows each, as in decode and verify
    steps: a block then reads its weight tile once for all of an expert's rows. More for prefill chunks, so that
    an expert's weights are re-read by fewer blocks."""
    per_expert = num_pairs / num_experts  # on average; a trained router's busiest experts get more
    return 64 if per_expert >= 64 else 32 if per_expert >= 32 else 16


def align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The layout's PyTorch form (`moe_routing.align`, one launch, is what the GEMMs take). Lays the token-expert
    pairs (pair p = token * k + j) out by expert, each expert's run padded to whole blocks: returns (slot_pairs
    [num_blocks * block_m], the pair in each slot or T*k for a pad; block_expert [num_blocks], each block's
    expert or -1 past the last). Within an expert, pairs keep token order. The number of blocks is the most any
    routing of this shape needs, so no count is read back."""
    pair_experts = topk_ids.reshape(-1)
    num_pairs, device = pair_experts.numel(), pair_experts.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, pair_experts, torch.ones_like(pair_experts))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded.cumsum(0)
    order = torch.argsort(pair_experts, stable=True)
    sorted_experts = pair_experts[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_experts]
    slots = (padded_ends - padded)[sorted_experts] + rank
    # Each expert's run wastes less than one block, and at most min(E, pairs) experts are touched.
    num_blocks = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    slot_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int64, device=device)
    slot_pairs[slots] = order
    starts = torch.arange(num_blocks, device=device) * block_m
    block_expert = torch.searchsorted(padded_ends, starts, right=True)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return slot_pairs, block_expert


def expert_outputs(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                   tiles: tuple[Tile, Tile] | None = None) -> torch.Tensor:
    """Each pair's unweighted expert output, [T*k, H] in pair order (token-major): w2[e] @ silu_and_mul(w13[e] @ x)
    with e the pair's expert. x [T, H], w13 [E, 2I, H] and w2 [E, H, I] with unit-stride rows. `tiles`: the two
    GEMMs' launch shapes (default: `DEFAULT_TILES`)."""
    num_tokens, k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    inter = two_i // 2
    gate_up, down = tiles or DEFAULT_TILES
    block_m = block_rows(num_tokens * k, num_experts)
    slot_pairs, block_expert = moe_routing.align(topk_ids, num_experts, block_m)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # tf32 only reaches fp32 inputs
    act = x.new_empty(block_expert.numel() * block_m, inter)
    _gemm(x, w13, act, slot_pairs, block_expert, num_tokens * k, k, gate_up, block_m, precision, gated=True)
    out = x.new_empty(num_tokens * k, hidden)
    _gemm(act, w2, out, slot_pairs, block_expert, num_tokens * k, k, down, block_m, precision, gated=False)
    return out


def _gemm(a: torch.Tensor, w: torch.Tensor, c: torch.Tensor, slot_pairs: torch.Tensor, block_expert: torch.Tensor,
          num_pairs: int, topk: int, tile: Tile, block_m: int, precision: str, gated: bool) -> None:
    """The gate-up GEMM (`gated`: rows gathered from tokens, SiLU-and-multiply, out by slot) or the down GEMM
    (rows by slot, out scattered to pairs)."""
    n = w.shape[1] // 2 if gated else w.shape[1]
    _expert_gemm_kernel[(block_expert.numel(), triton.cdiv(n, tile.block_n))](
        a, w, c, slot_pairs, block_expert, num_pairs, a.stride(0), w.stride(0), w.stride(1), c.stride(0),
        N=n, K=w.shape[2], TOPK=topk, GATHER_A=gated, SCATTER_C=not gated, GATED=gated, PRECISION=precision,
        BLOCK_M=block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, num_warps=tile.warps, num_stages=tile.stages)
