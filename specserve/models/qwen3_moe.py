"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's decoder with a sparse MoE block in place of the MLP in
its sparse layers (`decoder_sparse_step`, less `mlp_only_layers`; config.py lists them in `moe.sparse_layers`).

The block routes each token to its top-k experts by softmax over the router's logits (`norm_topk_prob`
rescales the chosen weights to sum to one) and sums their outputs; there are no shared experts.
"""
from __future__ import annotations

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.distributed.parallel import SINGLE, TensorParallel
from specserve.layers.linear import Linear
from specserve.layers.moe import FusedExperts
from specserve.layers.norm import RMSNorm
from specserve.models.llama import AttentionForm, DecoderLayer
from specserve.models.qwen3 import Qwen3ForCausalLM


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        """Under tensor parallelism the router is whole on every rank and each expert holds this rank's slice
        of its intermediate rows: one all-reduce sums the experts' partial outputs."""
        super().__init__()
        moe = cfg.moe
        self.top_k, self.norm_topk_prob, self.tp = moe.top_k, moe.norm_topk_prob, tp
        self.gate = Linear(cfg.hidden_size, moe.num_experts, bias=False)  # the router
        self.gate.takes_norm = True
        _, intermediate = tp.shard(moe.intermediate_size, "expert intermediate rows")
        self.experts = FusedExperts(moe.num_experts, cfg.hidden_size, intermediate)

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None, add: torch.Tensor | None = None) -> torch.Tensor:
        """experts(norm(x)) + add, as the dense MLP is called; norm and add are optional. Where the experts' kernels
        take it (decode on a GPU), the norm folds into them and the router's GEMV, and on one rank the add into
        their sum."""
        fold_add = add if self.tp.size == 1 else None  # across ranks the add follows the all-reduce
        if norm is not None and not self.experts.folds_norm(x, fold_add):
            x, norm = norm(x), None
        out = self.experts.softmax_routed(x, self.gate(x, norm=norm), self.top_k, self.norm_topk_prob, fold_add, norm)
        out = self.tp.all_reduce(out)
        return out if add is None or fold_add is not None else out + add


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    @staticmethod
    def decoder_layer(cfg: ModelConfig, form: AttentionForm, index: int, tp: TensorParallel) -> DecoderLayer:
        sparse = cfg.moe is not None and index in cfg.moe.sparse_layers
        return DecoderLayer(cfg, form, SparseMoeBlock(cfg, tp) if sparse else None, tp)
