"""Sizing and allocating the KV pool: how many pages fit, and the tensor that holds them."""
from __future__ import annotations

import torch

from specserve.config import CacheConfig, ModelConfig


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Every layer's entry (`ModelConfig.kv_entry_shape`: a dense model's keys and values, or MLA's latent)."""
    planes, heads, dim = cfg.kv_entry_shape
    return cfg.num_layers * planes * heads * dim * torch.empty((), dtype=dtype).element_size()


def dense_kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """What a cache of keys and values expanded per head would keep per token, every layer: the figure to set
    beside MLA's latent (a dense model's own figure otherwise)."""
    if cfg.mla is None:
        return kv_bytes_per_token(cfg, dtype)
    widths = cfg.mla.qk_nope_head_dim + cfg.mla.qk_rope_head_dim + cfg.mla.v_head_dim  # a head's key and value
    return cfg.num_layers * cfg.num_heads * widths * torch.empty((), dtype=dtype).element_size()


def plan_num_pages(per_token: int, cache: CacheConfig, free_bytes: int) -> int:
    """Pages that fit in `mem_fraction_static` of free memory, capped by `max_total_tokens`. `per_token` sums
    what every pool with the target's page layout keeps per token (the target's KV, a drafter's KV and taps)."""
    num_pages = int(free_bytes * cache.mem_fraction_static) // (per_token * cache.page_size)
    if cache.max_total_tokens is not None:
        num_pages = min(num_pages, -(-cache.max_total_tokens // cache.page_size))
    if num_pages < 1:
        raise MemoryError(f"no room for a KV page: {free_bytes / 2**30:.2f} GiB free")
    return num_pages


def allocate_kv_cache(cfg: ModelConfig, num_slots: int, dtype, device) -> torch.Tensor:
    """[layers, planes, slots, heads, dim]: slots stay the third dimension whatever a layer keeps per token, so
    moving a token's KV (`kv_cache[:, :, dst] = kv_cache[:, :, src]`) is one form for every model."""
    planes, heads, dim = cfg.kv_entry_shape
    return torch.zeros(cfg.num_layers, planes, num_slots, heads, dim, dtype=dtype, device=device)
