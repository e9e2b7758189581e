"""A rank's slices of heads, rows and vocabulary, and the per-rank config the KV pool is sized with."""
from __future__ import annotations

import pytest
import torch

from specserve.config import MLAConfig, ModelConfig
from specserve.distributed.parallel import SINGLE, TensorParallel, rank_model_config


def _config(heads: int = 8, kv_heads: int = 2, mla: MLAConfig | None = None) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=32, intermediate_size=48,
                       num_layers=2, num_heads=heads, num_kv_heads=kv_heads, head_dim=4, mla=mla)


def test_size_one_is_the_identity():
    x = torch.arange(6.0)
    assert SINGLE.all_reduce(x) is x and SINGLE.all_gather(x) is x
    assert SINGLE.shard(10) == (0, 10)
    config = _config()
    assert rank_model_config(config, SINGLE) is config


def test_shards_tile_the_whole():
    slices = [TensorParallel(rank, 4).shard(12) for rank in range(4)]
    assert slices == [(0, 3), (3, 3), (6, 3), (9, 3)]


def test_kv_heads_split_or_replicate():
    assert [TensorParallel(r, 2).kv_heads(4) for r in range(2)] == [(0, 2), (2, 2)]
    # Fewer KV heads than ranks: each rank holds the one its query heads read.
    assert [TensorParallel(r, 4).kv_heads(2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]


def test_rank_config_sizes_the_pool_per_rank():
    config = rank_model_config(_config(heads=8, kv_heads=1), TensorParallel(1, 2))
    assert (config.num_heads, config.num_kv_heads, config.kv_entry_shape) == (4, 1, (2, 1, 4))
    mla = MLAConfig(q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=4, qk_rope_head_dim=2, v_head_dim=4)
    config = rank_model_config(_config(heads=4, kv_heads=4, mla=mla), TensorParallel(0, 2))
    assert config.num_heads == 2 and config.kv_entry_shape == (1, 1, 18)  # the latent stays whole


def test_indivisible_heads_are_refused():
    with pytest.raises(ValueError, match="attention heads do not split evenly"):
        rank_model_config(_config(heads=6, kv_heads=6), TensorParallel(0, 4))
    with pytest.raises(ValueError, match="cannot be replicated evenly"):
        TensorParallel(0, 4).kv_heads(3)
    with pytest.raises(ValueError, match="not in a group"):
        TensorParallel(2, 2)
