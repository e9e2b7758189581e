"""Llama decoder (Llama 2/3/3.1, SmolLM2, TinyLlama), and the layers Llama-like architectures share: Qwen2
and Qwen3 differ from it only in their `AttentionForm` (qwen2.py, qwen3.py).

Only the math lives here. Attention metadata and the KV pool come in as arguments.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.distributed.parallel import SINGLE, TensorParallel, rank_model_config
from specserve.layers.attention import AttentionMetadata, attend
from specserve.layers.norm import RMSNorm
from specserve.layers.parallel import column_linear, row_linear, vocab_embedding
from specserve.layers.rotary import RotaryEmbedding
from specserve.models.base import CausalLM, StackedParams


STACKED_PARAMS: StackedParams = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


@dataclass(frozen=True)
class AttentionForm:
    """What sets a Llama-like architecture's attention apart; the rest of its decoder layer is Llama's."""

    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # an RMSNorm over each head's q and k, before rotary


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, form: AttentionForm, in_features: int | None = None,
                 tp: TensorParallel = SINGLE) -> None:
        """`in_features` defaults to the hidden size; an EAGLE-3 head reads [embedding; hidden] (2H). Under
        tensor parallelism this rank's heads only (`rank_model_config`)."""
        super().__init__()
        local = rank_model_config(cfg, tp)
        self.num_heads, self.num_kv_heads, self.head_dim = local.num_heads, local.num_kv_heads, cfg.head_dim
        self.q_size = local.num_heads * cfg.head_dim
        self.kv_size = local.num_kv_heads * cfg.head_dim
        self.qkv_proj = column_linear(in_features or cfg.hidden_size, self.q_size + 2 * self.kv_size, tp,
                                      bias=form.qkv_bias)
        self.qkv_proj.takes_norm = in_features is None  # a decoder layer's input norm; the head's input is normed
        self.o_proj = row_linear(self.q_size, cfg.hidden_size, tp, bias=form.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if form.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if form.qk_norm else None
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rotary: RotaryEmbedding,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        norm: RMSNorm | None = None,
        add: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """o_proj(attention(qkv_proj(norm(x)))) + add; norm and add are optional. With `rows`, only those rows'
        outputs (every row's keys and values are stored; `add` holds the chosen rows)."""
        q, k, v = self.qkv_proj(x, norm=norm).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        qk_norm = None if self.q_norm is None else (self.q_norm, self.k_norm)
        q, k = rotary.rotate_and_store(positions, q, k, v, kv_cache, meta.slot_mapping, qk_norm)
        out = attend(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out if rows is None else out[rows], add=add)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE, reduce: bool = True) -> None:
        """Under tensor parallelism this rank's slice of the intermediate rows; `reduce` False leaves the
        output a partial sum, for a caller that sums it with others in one all-reduce."""
        super().__init__()
        _, intermediate = tp.shard(cfg.intermediate_size, "intermediate rows")
        self.gate_up_proj = column_linear(cfg.hidden_size, 2 * intermediate, tp)
        self.gate_up_proj.gated = self.gate_up_proj.takes_norm = True
        self.down_proj = row_linear(intermediate, cfg.hidden_size, tp, reduce=reduce)

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None, add: torch.Tensor | None = None) -> torch.Tensor:
        """down(silu_and_mul(gate_up(norm(x)))) + add; norm and add are optional."""
        return self.down_proj(self.gate_up_proj.forward_gated(x, norm=norm), add=add)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, form: AttentionForm, mlp: nn.Module | None = None,
                 tp: TensorParallel = SINGLE) -> None:
        """`mlp` replaces the dense MLP (a MoE block); it is called as `MLP` is: mlp(x, norm=None, add=None)."""
        super().__init__()
        self.self_attn = Attention(cfg, form, tp=tp)
        self.mlp = MLP(cfg, tp) if mlp is None else mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, rotary, kv_cache, meta) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The residual stream arrives split in two, x + residual (residual None: x is all of it), and leaves
        the same way: each add is folded into the norm that follows it. Where `qkv_proj` runs as the Triton GEMV
        (bf16 steps of up to 16 rows where its tile beat cuBLAS: batch-1 decode on an 8B shape), the norms and
        adds fold into the GEMVs instead, and the stream leaves whole."""
        if self.self_attn.qkv_proj.folds_norm(x):
            stream = x if residual is None else x + residual
            stream = self.self_attn(stream, positions, rotary, kv_cache, meta, self.input_layernorm, add=stream)
            return self.mlp(stream, self.post_attention_layernorm, add=stream), None
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rotary, kv_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual

    @torch.no_grad()
    def move_norm_weights_into_projections(self) -> None:
        """RMSNorm(x) W^T = (x / rms(x)) (W diag(g))^T: each norm's weight g goes into the projection after it
        (rounded once, to the weight's dtype), and the norm keeps ones. Where a GEMV folds the norm in, it then
        only scales its output rows (kernels/triton/gemv.py). Projections with a bias never take the GEMV, so
        theirs stay."""
        pairs = [(self.input_layernorm, self.self_attn.qkv_proj)]
        if isinstance(self.mlp, MLP):  # a MoE block's router and experts both read its norm's output: it stays
            pairs.append((self.post_attention_layernorm, self.mlp.gate_up_proj))
        for norm, proj in pairs:
            if proj.bias is None:
                proj.weight.copy_(proj.weight.float() * norm.weight.float())
                norm.weight.fill_(1.0)
                proj.norm_in_weight = True


class LlamaForCausalLM(nn.Module, CausalLM):
    stacked_params = STACKED_PARAMS

    def __init__(self, cfg: ModelConfig, max_positions: int, tp: TensorParallel = SINGLE) -> None:
        """`tp`: this rank's place in a tensor-parallel group (docs/architecture.md says what is sharded)."""
        super().__init__()
        self.config, self.tp = cfg, tp
        self.embed_tokens = vocab_embedding(cfg.vocab_size, cfg.hidden_size, tp)
        form = self.attention_form(cfg)
        self.layers = nn.ModuleList(self.decoder_layer(cfg, form, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, max_positions, cfg.rope_theta, cfg.rope_scaling)
        self.lm_head = column_linear(cfg.hidden_size, tp.shard(cfg.vocab_size, "vocabulary rows")[1], tp)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @staticmethod
    def attention_form(cfg: ModelConfig) -> AttentionForm:
        """Llama's `attention_bias` puts biases on q, k, v and o alike."""
        return AttentionForm(qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias)

    @staticmethod
    def decoder_layer(cfg: ModelConfig, form: AttentionForm, index: int, tp: TensorParallel) -> DecoderLayer:
        """Decoder layer `index`; an architecture whose layers differ (MoE in some) overrides this."""
        return DecoderLayer(cfg, form, tp=tp)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,  # [num_layers, 2, num_slots, Hkv, D]
        capture_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns the final normed hidden states and the outputs of the layers in `capture_layers`, in that
        order (a layer may be named twice)."""
        x, residual = self.embed_tokens(input_ids), None
        outputs = {}
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, positions, self.rotary, kv_cache[i], meta)
            if i in capture_layers:
                # The layer's output, rounded as the unfused add rounds it.
                outputs[i] = x if residual is None else x + residual
        hidden = self.norm(x) if residual is None else self.norm(x, residual)[0]
        return hidden, [outputs[i] for i in capture_layers]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather(self.lm_head(hidden), dim=-1)  # each rank's vocabulary slice, in rank order
