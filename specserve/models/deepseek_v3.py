"""DeepSeek-V3 decoder (DeepSeek-V3/R1, Kimi-K2, Moonlight): multi-head latent attention (layers/mla.py) over a
cache of latents, and mixture-of-experts MLPs with shared experts in every layer of `MoEConfig.sparse_layers`
(dense MLPs in the `first_k_dense_replace` layers before them).

Routing is DeepSeek-V3's "noaux_tc": sigmoid scores; a per-expert correction bias shifts which experts are chosen
but not their weights; experts come only from the `topk_group` groups whose two best biased scores sum highest;
the chosen weights are renormalised (`norm_topk_prob`) and scaled by `routed_scaling_factor`.
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from specserve.config import ModelConfig, MoEConfig
from specserve.distributed.parallel import SINGLE, TensorParallel
from specserve.kernels import moe as moe_kernels
from specserve.layers.attention import AttentionMetadata
from specserve.layers.mla import MultiHeadLatentAttention
from specserve.layers.moe import FusedExperts
from specserve.layers.norm import RMSNorm
from specserve.layers.parallel import column_linear, vocab_embedding
from specserve.layers.rotary import RotaryEmbedding
from specserve.models.base import CausalLM, StackedParams
from specserve.models.llama import MLP

# MLA's projections stay apart (q_proj is the queries', not part of a fused qkv); only gate/up fuse.
STACKED_PARAMS: StackedParams = {
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class GroupedTopKRouter(nn.Module):
    """DeepSeek-V3's router: `weight` [E, H] and `e_score_correction_bias` [E], kept and applied in fp32 whatever
    the model's dtype, as the checkpoints store them and transformers keeps them: sigmoid scores crowd near
    one, where bf16 steps are coarse enough to change which experts win."""

    def __init__(self, hidden_size: int, moe: MoEConfig) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size, dtype=torch.float32))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts, dtype=torch.float32))

    def _apply(self, fn, recurse=True):
        # `model.to(dtype)` casts every parameter; this module's go back to fp32 (on whatever device they went to).
        super()._apply(fn, recurse)
        for param in (self.weight, self.e_score_correction_bias):
            param.data = param.data.float()
        return self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] fp32, expert ids [T, k] int64) of x [T, H]."""
        cfg = self.moe
        return moe_kernels.grouped_topk(F.linear(x.float(), self.weight), self.e_score_correction_bias, cfg.top_k,
                                        cfg.n_group, cfg.topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)


class DeepseekV3MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        """Under tensor parallelism the router is whole on every rank; routed and shared experts hold this
        rank's slice of their intermediate rows, and one all-reduce sums both partial outputs."""
        super().__init__()
        moe = cfg.moe
        self.tp = tp
        self.gate = GroupedTopKRouter(cfg.hidden_size, moe)
        _, intermediate = tp.shard(moe.intermediate_size, "expert intermediate rows")
        self.experts = FusedExperts(moe.num_experts, cfg.hidden_size, intermediate)
        self.shared_experts = None
        if moe.num_shared_experts:  # one MLP as wide as all shared experts together
            shared = replace(cfg, intermediate_size=moe.intermediate_size * moe.num_shared_experts)
            self.shared_experts = MLP(shared, tp, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
        return self.tp.all_reduce(out if self.shared_experts is None else self.shared_experts(x, add=out))


class DeepseekV3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.self_attn = MultiHeadLatentAttention(cfg, tp)
        sparse = cfg.moe is not None and index in cfg.moe.sparse_layers
        self.mlp = DeepseekV3MoE(cfg, tp) if sparse else MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, rotary, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream arrives split in two, x + residual (residual None: x is all of it), and leaves
        the same way: each add is folded into the norm that follows it."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rotary, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class DeepseekV3ForCausalLM(nn.Module, CausalLM):
    stacked_params = STACKED_PARAMS

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TensorParallel = SINGLE) -> None:
        """`tp`: this rank's place in a tensor-parallel group (docs/architecture.md says what is sharded)."""
        super().__init__()
        if cfg.mla is None:
            raise ValueError("DeepseekV3ForCausalLM needs MLA settings (kv_lora_rank and the head dims)")
        self.config, self.tp = cfg, tp
        self.embed_tokens = vocab_embedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DeepseekV3DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.mla.qk_rope_head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.lm_head = column_linear(cfg.hidden_size, tp.shard(cfg.vocab_size, "vocabulary rows")[1], tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def skips_checkpoint_tensor(self, name: str) -> bool:
        """DeepSeek-V3's checkpoints carry multi-token-prediction layers after the last decoder layer
        (`model.layers.61.*`); they draft, and nothing here reads them."""
        parts = name.removeprefix("model.").split(".")
        return parts[0] == "layers" and int(parts[1]) >= self.config.num_layers

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,  # [num_layers, 1, num_slots, 1, kv_lora_rank + qk_rope_head_dim]
        capture_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns the final normed hidden states and the outputs of the layers in `capture_layers`, in that
        order (a layer may be named twice)."""
        x, residual = self.embed_tokens(input_ids), None
        outputs = {}
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, self.rotary, kv_cache[i], meta)
            if i in capture_layers:
                outputs[i] = x + residual
        return self.norm(x, residual)[0], [outputs[i] for i in capture_layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(self.lm_head(hidden), dim=-1)  # each rank's vocabulary slice, in rank order
