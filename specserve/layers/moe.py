"""Mixture-of-experts layers: one layer's routed experts with their weights stacked (`FusedExperts`), and the
routing functions that choose each token's experts and weights.

A MoE block is router -> routing function -> `FusedExperts` (plus, where an architecture has them, shared
experts added to the result); the blocks themselves are the model files' (models/qwen3_moe.py).
"""
from __future__ import annotations

import torch
from torch import nn

from specserve.kernels import moe


class FusedExperts(nn.Module):
    """All routed experts of one layer, each a SiLU-gated MLP, stacked: `w13` [E, 2I, H] holds each expert's
    gate rows, then its up rows; `w2` [E, H, I] its down projection. Under tensor parallelism I is this rank's
    slice of every expert's intermediate rows and the output a partial sum (`tp_dims`: the dimension of each
    expert's checkpoint tensor that is sliced, for models/loader.py)."""

    tp_dims = {"w13": 0, "w2": 1}

    # One expert's projection in a checkpoint (`...experts.{e}.gate_proj.weight`) -> (stacked parameter, shard):
    # models/loader.py copies gate_proj into the first I rows of w13[e], up_proj into the last I, down_proj
    # into w2[e].
    CHECKPOINT_NAMES: dict[str, tuple[str, int | None]] = {
        "gate_proj": ("w13", 0),
        "up_proj": ("w13", 1),
        "down_proj": ("w2", None),
    }

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], topk_weights [T, k] (fp32), topk_ids [T, k] (int64) -> [T, H]: per token, the sum over its
        k experts of weight * down(silu(gate(x)) * up(x)). Each touched expert runs once, over all its rows."""
        return moe.fused_experts(x, self.w13, self.w2, topk_weights, topk_ids)


def softmax_topk(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen-MoE (and Mixtral) routing: softmax over all experts, the top_k largest, renormalised to sum to one
    where the config's `norm_topk_prob` says (kernels/moe.softmax_topk). Returns (weights [T, k] fp32, expert ids
    [T, k] int64)."""
    return moe.softmax_topk(router_logits, top_k, renormalize)
