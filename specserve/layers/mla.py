"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) over a paged cache of latents.

A token's KV is its compressed latent c (`kv_lora_rank` values, normed) and one rotary key k_pe that every head
shares (`qk_rope_head_dim`): the row [c | k_pe] is all that one layer of the pool keeps per token
(`ModelConfig.kv_entry_shape`). Head h's key is [W_UK[h] c | k_pe] and its value W_UV[h] c, where W_UK and W_UV
are the two blocks of `kv_b_proj`.

The same attention runs in one of two forms:
- absorbed, in every step that reads the cache (decode, chunked prefill, chain and tree verify): q_nope goes
  through W_UK into the latent space, every head attends over the cached rows as they are (multi-query attention
  with a single KV head of the latent's width), and its output, a mix of latents, goes through W_UV. Nothing is
  expanded per context token, so a step reads kv_lora_rank + qk_rope_head_dim values per token of context.
- expanded, in steps whose rows are all fresh prompts (they attend only to themselves): keys and values are made
  from the step's own latents, and attention runs at the heads' own widths, fewer operations where queries are
  many.
Both go through layers/attention.py's `attend`, so masks, draft trees and the step-program row forms apply as
for dense models. On a GPU the row form (decode graphs, step programs) runs kernels/triton/mla_attention.py,
which reads the latent pages in place.
"""
from __future__ import annotations

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.distributed.parallel import SINGLE, TensorParallel
from specserve.layers.attention import AttentionMetadata, attend, attend_rows
from specserve.layers.linear import Linear
from specserve.layers.norm import RMSNorm
from specserve.layers.parallel import column_linear, row_linear
from specserve.layers.rotary import RotaryEmbedding, yarn_mscale

LATENT_NORM_EPS = 1e-6  # DeepSeek's q_a_layernorm and kv_a_layernorm keep the default, whatever rms_norm_eps is


class MultiHeadLatentAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE) -> None:
        """Under tensor parallelism this rank's query heads only (q_proj or q_b_proj, kv_b_proj and o_proj
        split by heads); the latent path (q_a_proj, kv_a_proj_with_mqa) and the latent cache stay whole on every
        rank, since every head reads all of the latent."""
        super().__init__()
        m = cfg.mla
        self.num_heads, self.rank = tp.shard(cfg.num_heads, "attention heads")[1], m.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        qk_dim = self.nope_dim + self.rope_dim
        if m.q_lora_rank is None:
            self.q_proj = column_linear(cfg.hidden_size, self.num_heads * qk_dim, tp)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, m.q_lora_rank, bias=cfg.attention_bias)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = column_linear(m.q_lora_rank, self.num_heads * qk_dim, tp)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, m.latent_dim, bias=cfg.attention_bias)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = column_linear(m.kv_lora_rank, self.num_heads * (self.nope_dim + self.v_dim), tp)
        self.o_proj = row_linear(self.num_heads * self.v_dim, cfg.hidden_size, tp, bias=cfg.attention_bias)
        self.scale = qk_dim**-0.5 * softmax_mscale(cfg) ** 2
        # Interleaved rotary pairs (x0, x1), (x2, x3) become halves, the layout rotary.py rotates.
        halves = torch.cat([torch.arange(0, self.rope_dim, 2), torch.arange(1, self.rope_dim, 2)])
        self.register_buffer("rope_order", halves if m.rope_interleave else None, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: RotaryEmbedding, kv_cache: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """o_proj(attention(x)) for x [T, H]; stores each token's [c | k_pe] at `meta.slot_mapping` in this
        layer's cache, [1, num_slots, 1, latent_dim]."""
        tokens = x.shape[0]
        q = self._queries(x).view(tokens, self.num_heads, self.nope_dim + self.rope_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        latent = self.kv_a_proj_with_mqa(x)
        if self._latent_kernels(latent, kv_cache, meta):
            return self.o_proj(self.attend_latent_kernels(q_nope, q_pe, latent, positions, rotary, kv_cache, meta))
        c, k_pe = latent.split([self.rank, self.rope_dim], dim=-1)
        c = self.kv_a_layernorm(c)
        q_pe, k_pe = rotary(positions, self._halved(q_pe), self._halved(k_pe).view(tokens, 1, self.rope_dim))
        entry = torch.cat([c, k_pe.view(tokens, self.rope_dim)], dim=-1).view(tokens, 1, -1)
        kv_cache[0].index_copy_(0, meta.slot_mapping, entry)
        if only_fresh_prompts(meta):
            out = self.attend_expanded(q_nope, q_pe, c, k_pe, kv_cache, meta)
        else:
            out = self.attend_absorbed(q_nope, q_pe, entry, kv_cache, meta)
        return self.o_proj(out)

    def attend_absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, entry: torch.Tensor,
                        kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention in the latent space over the cache (which already holds this step's `entry` rows):
        [T, heads * v_dim]."""
        w_uk, w_uv = self._up_projections()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, heads, rank]
        q = torch.cat([q_latent, q_pe], dim=-1)
        # One plane serves as keys and as values: a value's last rope_dim entries (k_pe) come out as extra
        # output columns, dropped below.
        planes = kv_cache.expand(2, -1, -1, -1)
        if meta.block_tables is not None:  # the row form (decode graphs, step programs), in PyTorch
            out = attend_rows(q, planes, meta, self.scale)
        else:
            out = attend(q, entry, entry, planes, meta, self.scale)
        return self._values(out.view(q.shape[0], self.num_heads, -1)[..., :self.rank], w_uv)

    def attend_latent_kernels(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                              positions: torch.Tensor, rotary: RotaryEmbedding, kv_cache: torch.Tensor,
                              meta: AttentionMetadata) -> torch.Tensor:
        """`attend_absorbed` of the row form on a GPU, from kv_a_proj's output `latent` [T, rank + rope]: one
        kernel norms c, rotates k_pe and q_pe and stores the cache row (eight launches in the form above),
        another attends over the latent pages in place (kernels/triton/mla_attention.py)."""
        from specserve.kernels.triton import pointwise as triton_pointwise  # Triton: GPU machines only
        from specserve.kernels.triton.mla_attention import mla_decode_attention

        tokens = latent.shape[0]
        w_uk, w_uv = self._up_projections()
        q = latent.new_empty(tokens, self.num_heads, self.rank + self.rope_dim)
        triton_pointwise.mla_rotary_store(positions, rotary.cos_sin, q_pe, latent, self.kv_a_layernorm.weight,
                                          self.kv_a_layernorm.eps, kv_cache[0], meta.slot_mapping, q,
                                          interleaved=self.rope_order is not None)
        q[..., :self.rank] = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        mixed = mla_decode_attention(q, kv_cache[0], self.rank, meta.block_tables, meta.seq_lens, self.scale,
                                     meta.page_size, meta.num_splits, meta.tail_slots, meta.tail_lens,
                                     meta.rows_per_seq)
        return self._values(mixed, w_uv)

    def _latent_kernels(self, latent: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
        """Whether this step takes `attend_latent_kernels`: the row form, on a GPU, shapes the kernels tile."""
        return (meta.block_tables is not None and latent.is_cuda and latent.dtype == kv_cache.dtype
                and self.kv_a_layernorm.weight.dtype == latent.dtype and latent.stride(-1) == 1
                and latent_kernel_takes(self.rank, self.rope_dim))

    def _values(self, mixed: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        """Each head's mix of latents [T, heads, rank] through W_UV: [T, heads * v_dim]."""
        return torch.bmm(mixed.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1).reshape(mixed.shape[0], -1)

    def attend_expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, c: torch.Tensor, k_pe: torch.Tensor,
                        kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of fresh prompts over themselves, keys and values expanded from their latents:
        [T, heads * v_dim]."""
        tokens = c.shape[0]
        k_nope, v = self.kv_b_proj(c).view(tokens, self.num_heads, -1).split([self.nope_dim, self.v_dim], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(tokens, self.num_heads, self.rope_dim)], dim=-1)
        # attend's output has the queries' width: values are padded to it, and the padding dropped after.
        v = torch.nn.functional.pad(v, (0, q.shape[-1] - self.v_dim))
        out = attend(q, k, v, kv_cache.expand(2, -1, -1, -1), meta, self.scale)
        return out.view(tokens, self.num_heads, -1)[..., :self.v_dim].reshape(tokens, -1)

    def _queries(self, x: torch.Tensor) -> torch.Tensor:
        if hasattr(self, "q_proj"):
            return self.q_proj(x)
        return self.q_b_proj(self.q_a_proj(x), norm=self.q_a_layernorm)

    def _halved(self, x: torch.Tensor) -> torch.Tensor:
        return x if self.rope_order is None else x.index_select(-1, self.rope_order)

    def _up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [heads, nope_dim, rank] and W_UV [heads, v_dim, rank]: views of kv_b_proj's weight."""
        weight = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        return weight[:, :self.nope_dim], weight[:, self.nope_dim:]


def latent_kernel_takes(rank: int, rope_dim: int) -> bool:
    """kernels/triton/mla_attention.py tiles the latent and the rotary key whole: powers of two, 16 or more."""
    return all(n >= 16 and not n & (n - 1) for n in (rank, rope_dim))


def only_fresh_prompts(meta: AttentionMetadata) -> bool:
    """Whether every row of the step attends only to rows of the same step (prompts with nothing cached)."""
    return (meta.block_tables is None and meta.decode_rows is None and bool(meta.groups)
            and all(group.self_attention for group in meta.groups))


def softmax_mscale(cfg: ModelConfig) -> float:
    """DeepSeek's YaRN correction of the softmax scale (squared where it is applied), from `mscale_all_dim`."""
    scaling = cfg.rope_scaling
    if scaling is None or scaling.rope_type != "yarn" or not scaling.mscale_all_dim:
        return 1.0
    return yarn_mscale(scaling.factor, scaling.mscale_all_dim)
