"""Sizing and allocating the KV pool: how many pages fit, and the tensor that holds them."""
from __future__ import annotations

import torch

from specserve.config import CacheConfig, ModelConfig


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()


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
    return torch.zeros(cfg.num_layers, 2, num_slots, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device)
