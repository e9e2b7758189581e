"""Turns one StepBatch into tensors, runs the model, samples. Holds the model and the KV pool, nothing
about requests beyond the step in hand."""
from __future__ import annotations

import torch

from specserve.config import CacheConfig, ModelConfig
from specserve.engine.scheduler import StepBatch
from specserve.layers.attention import AttentionMetadata
from specserve.layers.sampler import sample


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device

    @torch.inference_mode()
    def execute(self, batch: StepBatch) -> list[int]:
        """Runs the step and returns one new token per sequence whose `sample` flag is set, in order."""
        seqs = batch.seqs
        input_ids = torch.tensor([t for s in seqs for t in s.token_ids], device=self.device)
        positions = torch.cat(
            [torch.arange(s.start_pos, s.start_pos + len(s.token_ids)) for s in seqs]
        ).to(self.device)
        meta = AttentionMetadata.build(
            [len(s.token_ids) for s in seqs], [s.start_pos for s in seqs], [s.page_ids for s in seqs],
            batch.page_size, self.device,
        )
        hidden, _ = self.model(input_ids, positions, meta, self.kv_cache)
        sampling = [s for s in seqs if s.sample]
        if not sampling:
            return []
        ends = torch.tensor([len(s.token_ids) for s in seqs]).cumsum(0) - 1
        rows = ends[torch.tensor([s.sample for s in seqs])].to(self.device)
        logits = self.model.compute_logits(hidden[rows]).float()
        tokens = sample(logits, [s.params for s in sampling], [s.sample_seed for s in sampling])
        return tokens.tolist()


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * torch.empty((), dtype=dtype).element_size()


def plan_num_pages(
    cfg: ModelConfig, cache: CacheConfig, dtype: torch.dtype, free_bytes: int, max_model_len: int
) -> int:
    """Pages that fit in `mem_fraction_static` of free memory, capped by `max_total_tokens`."""
    by_memory = int(free_bytes * cache.mem_fraction_static) // (kv_bytes_per_token(cfg, dtype) * cache.page_size)
    num_pages = by_memory
    if cache.max_total_tokens is not None:
        num_pages = min(num_pages, -(-cache.max_total_tokens // cache.page_size))
    if num_pages < 1:
        raise MemoryError(f"no room for a KV page: {free_bytes / 2**30:.2f} GiB free")
    return num_pages


def allocate_kv_cache(cfg: ModelConfig, num_pages: int, page_size: int, dtype, device) -> torch.Tensor:
    return torch.zeros(
        cfg.num_layers, 2, num_pages * page_size, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=device
    )
