"""The model contract: what the engine, the speculative code, the loader and training need from a target model.

A target model is a causal LM that reads and writes the paged KV pool. The runner calls its forward on a step's
tokens and its `compute_logits` on the rows it samples; the speculative code also taps chosen layers' outputs
and looks tokens up in the embedding; the loader fills its parameters from a Hugging Face checkpoint; training
reads its embedding, final norm and lm_head. Model files hold only this math: attention metadata and the KV pool
come in as arguments. A new architecture is one file implementing `CausalLM` and one line in models/registry.py.
"""
from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar, Protocol, runtime_checkable

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.distributed.parallel import TensorParallel
from specserve.layers.attention import AttentionMetadata
from specserve.layers.rotary import RotaryEmbedding

# Checkpoint tensor name -> (fused parameter name, shard index): q/k/v load into one qkv_proj, gate/up into one
# gate_up_proj, each shard a block of output rows in that order.
StackedParams = dict[str, tuple[str, int]]


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only language model over the paged KV pool. Shapes: T tokens in a step, H the hidden size, V the
    vocabulary, L layers."""

    config: ModelConfig
    """Its architecture. The engine sizes the KV pool from it (`num_layers`, `num_kv_heads`, `head_dim`), the
    graphs and step programs their buffers (`hidden_size`, `num_kv_heads`), the loader checks the checkpoint
    against it (`tie_word_embeddings`, shard sizes) and training shapes a draft head like one of its layers."""

    tp: TensorParallel
    """This rank's place in its tensor-parallel group (one rank unless built with one). `config` stays the whole
    model's; `distributed.parallel.rank_model_config(config, tp)` gives the heads this rank holds, which size its
    KV pool. `compute_logits` returns the whole vocabulary on every rank."""

    stacked_params: ClassVar[StackedParams]
    """How the loader maps the checkpoint's separate projections into the model's fused ones."""

    embed_tokens: nn.Embedding
    """The token embedding, [V, H]. EAGLE-3 heads read it (they have none of their own): called on ids, or its
    `weight` looked up inside a fused kernel."""

    norm: nn.Module
    """The final RMSNorm, whose `weight` ([H]) a new draft head starts from."""

    lm_head: nn.Linear
    """The output projection, [V, H] (the embedding's weight when tied). Training reads its rows of the draft
    vocabulary as the target's logits."""

    rotary: RotaryEmbedding
    """Rotary angles for every position the model may see. The loader keeps them in fp32 whatever the dtype."""

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        capture_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """One step over `input_ids` [T] at `positions` [T]: stores every token's keys and values at
        `meta.slot_mapping` in `kv_cache` [L, 2, num_slots, Hkv, head_dim] and attends as `meta` describes.

        Returns the final normed hidden states [T, H] and the outputs of the layers in `capture_layers` ([T, H]
        each, in that order; a layer may be named twice): the taps an EAGLE-3 head drafts from and training
        records. Called through the module (`model(...)`), so inside CUDA graphs too: no host sync, no I/O."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Next-token logits [R, V] of hidden states [R, H] from `forward`; the runner passes only the rows it
        samples or verifies."""


@runtime_checkable
class NormFoldable(Protocol):
    """Optional, for a model's submodules (a decoder layer): the loader calls this once after loading where the
    GEMV kernels fold norms (bf16 on a GPU), so each RMSNorm's weight moves into the projection after it."""

    def move_norm_weights_into_projections(self) -> None:
        """Multiplies each norm's weight into the next projection's input columns and sets the norm's to ones."""
