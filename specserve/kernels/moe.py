"""Mixture-of-experts math: each token through the SiLU-gated MLPs of the experts its router chose, weighted and
summed.

One MoE layer's experts are stacked: `w13` [E, 2I, H] (each expert's gate rows, then its up rows) and `w2`
[E, H, I]. The token-expert pairs are sorted by expert, so each touched expert runs once over all the rows
routed to it: its weights are read once per call, however many rows chose it, which is what decode and verify
steps (few rows, many experts) are bound by.

On a GPU (CUDA tensors, no autograd) a call takes the grouped GEMMs of kernels/triton/fused_moe.py, which
need no host sync and so run inside CUDA graphs too; at decode's few rows, the per-pair GEMVs of
kernels/triton/moe_decode.py instead (`PAIR_GEMV_TOKENS`). Elsewhere it takes the PyTorch form.
"""
from __future__ import annotations

import functools
import types

import torch
import torch.nn.functional as F

from specserve import envs
from specserve.kernels import pointwise

# Steps of at most this many rows take the per-pair GEMVs: while few rows share an expert, dropping the layout
# and sum launches outweighs reading a shared expert once per row. On a Qwen3-30B-A3B layer they were faster up
# to 8 rows and slower at 16 (benchmarks/results/fused_moe_qwen3_30b_a3b_h100.json).
PAIR_GEMV_TOKENS = 8


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H], topk_weights [T, k] (fp32), topk_ids [T, k] -> [T, H] in x's dtype: for each token,
    sum over its k experts e of weight * w2[e] @ silu_and_mul(w13[e] @ x), plus `add` [T, H] where given."""
    gpu = _gpu_form(x, w13, w2)
    if gpu is not None and _pair_gemvs(x, add):
        gate_up, down = gpu.moe_decode.tiles(envs.get().moe_gemv_tiles)
        act, _, _ = gpu.moe_decode.gate_up(x, w13, topk_ids.shape[1], topk_ids=topk_ids, tile=gate_up)
        return gpu.moe_decode.down_sum(act, w2, topk_ids, topk_weights, x.dtype, add, tile=down)
    if gpu is not None:
        out = gpu.moe_routing.weighted_sum(gpu.fused_moe.expert_outputs(x, w13, w2, topk_ids), topk_weights, x.dtype)
    elif x.is_cuda and torch.cuda.is_current_stream_capturing():
        out = gathered_experts(x, w13, w2, topk_weights, topk_ids)
    else:
        out = eager_fused_experts(x, w13, w2, topk_weights, topk_ids)
    return out if add is None else out + add


def softmax_routed_experts(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                           top_k: int, renormalize: bool, add: torch.Tensor | None = None,
                           norm: tuple[torch.Tensor, float] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_experts` of RMSNorm(x) (`norm`: its weight and eps; None: x as it is) with the experts chosen by
    `softmax_topk` of the router's logits [T, E]. Returns (the output [T, H], the expert ids [T, k]). At decode's
    few rows on a GPU the norm and the routing run inside the first GEMV's programs, so a MoE layer's experts
    are two launches."""
    gpu = _gpu_form(x, w13, w2)
    if (gpu is not None and _pair_gemvs(x, add) and router_logits.stride(-1) == 1
            and (norm is None or norm[0].dtype == x.dtype)):
        gate_up, down = gpu.moe_decode.tiles(envs.get().moe_gemv_tiles)
        act, ids, weights = gpu.moe_decode.gate_up(x, w13, top_k, router_logits=router_logits,
                                                   renormalize=renormalize, norm=norm, tile=gate_up)
        return gpu.moe_decode.down_sum(act, w2, ids, weights, x.dtype, add, tile=down), ids
    if norm is not None:
        x = pointwise.rms_norm(x, *norm)
    weights, ids = softmax_topk(router_logits, top_k, renormalize)
    return fused_experts(x, w13, w2, weights, ids, add), ids


def eager_fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                        topk_ids: torch.Tensor) -> torch.Tensor:
    """`fused_experts` in PyTorch, the form kernels are held to: pairs sorted by expert (stably, so each expert
    sees its rows in token order), one pair of matmuls per touched expert. Reads the per-expert row counts on
    the host, so it cannot run inside a CUDA graph."""
    num_tokens, k = topk_ids.shape
    pair_experts = topk_ids.reshape(-1)
    order = torch.argsort(pair_experts, stable=True)
    rows = x.index_select(0, order // k)  # the token of each pair, in expert order
    by_expert = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(torch.bincount(pair_experts, minlength=w13.shape[0]).tolist()):
        if count:
            gate_up = F.linear(rows[start:start + count], w13[expert])
            torch.matmul(pointwise.silu_and_mul(gate_up), w2[expert].t(), out=by_expert[start:start + count])
            start += count
    out = torch.empty_like(by_expert).index_copy_(0, order, by_expert)  # back to pair order
    return _weighted_sum(out, topk_weights, x.dtype)


def gathered_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                     topk_ids: torch.Tensor) -> torch.Tensor:
    """`fused_experts` without a host sync, for CUDA graphs without the fused kernel: each pair gathers its
    expert's weights, so an expert chosen by n rows is read n times."""
    num_tokens, k = topk_ids.shape
    pair_experts = topk_ids.reshape(-1)
    rows = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # [T*k, H, 1]
    gate_up = torch.bmm(w13[pair_experts], rows).squeeze(-1)
    out = torch.bmm(w2[pair_experts], pointwise.silu_and_mul(gate_up).unsqueeze(-1)).squeeze(-1)
    return _weighted_sum(out, topk_weights, x.dtype)


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen-MoE (and Mixtral) routing: softmax over all experts in fp32, the top_k largest; with `renormalize`
    (a config's `norm_topk_prob`) the chosen weights are scaled to sum to one. Returns (weights [T, k] fp32,
    expert ids [T, k] int64). On a GPU one Triton launch; elsewhere, and where k is not a power of two, PyTorch."""
    gpu = _triton_moe() if router_logits.is_cuda and not torch.is_grad_enabled() else None
    if gpu is not None and top_k & (top_k - 1) == 0 and router_logits.stride(-1) == 1:
        return gpu.moe_routing.softmax_topk(router_logits, top_k, renormalize)
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def grouped_topk(router_logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                 renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing ("noaux_tc") of the router's fp32 logits [T, E]: sigmoid scores; the per-expert
    correction `bias` shifts which experts are chosen but not their weights; experts come only from the
    `topk_group` of `n_group` groups whose two best biased scores sum highest; the chosen scores are
    renormalised to sum to one and multiplied by `scale`. Returns (weights [T, k] fp32, expert ids [T, k] int64).
    On a GPU one Triton launch, largest biased score first; elsewhere PyTorch, in no set order."""
    gpu = _triton_moe() if router_logits.is_cuda and not torch.is_grad_enabled() else None
    if gpu is not None and router_logits.stride(-1) == 1:
        return gpu.moe_routing.grouped_topk(router_logits, bias, top_k, n_group, topk_group, renormalize, scale)
    return eager_grouped_topk(router_logits, bias, top_k, n_group, topk_group, renormalize, scale)


def eager_grouped_topk(router_logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                       renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`grouped_topk` in PyTorch, the form the kernel is held to."""
    scores = router_logits.sigmoid()
    biased = scores + bias
    if n_group > 1:
        tokens, per_group = scores.shape[0], scores.shape[1] // n_group
        group_scores = biased.view(tokens, n_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        best_groups = group_scores.topk(topk_group, dim=-1, sorted=False)[1]
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        biased = biased.masked_fill(~allowed.repeat_interleave(per_group, dim=1), float("-inf"))
    ids = biased.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def pair_gemvs_take(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, add: torch.Tensor | None = None) -> bool:
    """Whether a call on x (with `add`) runs the pair GEMVs, which fold a norm in."""
    return _gpu_form(x, w13, w2) is not None and _pair_gemvs(x, add)


def _pair_gemvs(x: torch.Tensor, add: torch.Tensor | None) -> bool:
    """The pair GEMVs take this call: few rows, and an `add` they can read (unit-stride rows in x's dtype)."""
    addable = add is None or (add.stride(-1) == 1 and add.dtype == x.dtype)
    return x.shape[0] <= PAIR_GEMV_TOKENS and addable and envs.get().moe_pair_gemv


def _gpu_form(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor):
    """The Triton kernels' module where they take this call, else None."""
    if not x.is_cuda or torch.is_grad_enabled() or not x.stride(-1) == w13.stride(-1) == w2.stride(-1) == 1:
        return None
    return _triton_moe()


def _triton_moe():
    return _triton_moe_module() if envs.get().fused_moe else None


@functools.cache
def _triton_moe_module():
    try:  # imported at the first GPU call: CPU-only runs never load Triton
        from specserve.kernels.triton import fused_moe, moe_decode, moe_routing
    except ImportError:
        return None
    return types.SimpleNamespace(fused_moe=fused_moe, moe_decode=moe_decode, moe_routing=moe_routing)


def _weighted_sum(pair_out: torch.Tensor, topk_weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T*k, H] expert outputs in token-major pair order -> [T, H]: weighted and summed in fp32, over k in a
    fixed order (no atomics, so a step's output does not depend on the run)."""
    num_tokens, k = topk_weights.shape
    pairs = pair_out.view(num_tokens, k, -1).float()
    return (pairs * topk_weights.float().unsqueeze(-1)).sum(dim=1).to(dtype)
