"""The standalone draft model drafter: a smaller causal LM with the target's tokenizer."""
from __future__ import annotations

import random
from pathlib import Path

import torch

from specserve.config import EngineConfig, ModelConfig
from specserve.core import ScheduledSeq
from specserve.kv.pool import allocate_kv_cache, kv_bytes_per_token
from specserve.models.loader import build_model, read_model_config
from specserve.speculative.base import Speculator
from specserve.speculative.drafters.base import catch_up_meta, split_catch_up
from specserve.speculative.search import TreeProposer, scratch_slots


class DraftModelDrafter:
    """A smaller causal LM with the target's tokenizer. At position j it reads token j, like the target."""

    shift = 0
    capture_layers: tuple[int, ...] = ()

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, device: torch.device) -> None:
        self.model = model
        self.attention_config = model.config
        self.kv_cache = kv_cache
        self.device = device

    def catch_up(self, seqs: list[ScheduledSeq], page_size: int) -> tuple[torch.Tensor, None]:
        # Every token from the first the draft has not seen up to the root, itself included.
        passes, chunks = split_catch_up([(s.draft_catchup_ids, s.draft_start_pos) for s in seqs])
        for pieces in passes:
            self._extend_over([(ids, p) for _, ids, p in pieces], [seqs[b] for b, _, _ in pieces], page_size)
        hidden, last = self._extend_over(chunks, seqs, page_size)
        return self.model.compute_logits(hidden[last]), None

    def _extend_over(self, chunks, seqs, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft model over (tokens, first position) chunks, one per sequence: its hidden states, and each
        chunk's last row."""
        input_ids, positions, meta, last = catch_up_meta(chunks, seqs, page_size, self.device)
        hidden, _ = self.model(input_ids, positions, meta, self.kv_cache)
        return hidden, last

    def extend(self, tokens, states, positions, meta) -> tuple[torch.Tensor, None]:
        hidden, _ = self.model(tokens, positions, meta, self.kv_cache)
        return self.model.compute_logits(hidden), None

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids

    def observe(self, captured, slot_mapping) -> None:
        pass

    def move_slots(self, src, dst) -> None:
        pass  # drafts' KV is recomputed from the accepted tokens at the next catch-up


class DraftModel:
    """`--speculative-algorithm DRAFT_MODEL`: a smaller causal LM with the target's tokenizer, drafting through
    the general search."""

    def load(self, config: EngineConfig, target_cfg: ModelConfig, dtype, device, max_model_len: int,
             progress: bool) -> torch.nn.Module:
        path = Path(config.spec.draft_model_path).expanduser()
        if path.suffix == ".gguf" and path.is_file():
            from specserve.models.gguf import cached_conversion  # needs the gguf package; HF dirs don't

            # The same cache as a GGUF target's conversion (engine/factory.py default_cache_root).
            cache_root = Path(config.cache_dir) if config.cache_dir else Path.home() / ".cache" / "specserve"
            path = cached_conversion(path, cache_root)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"no config.json in the draft model path {path}")
        draft_cfg = read_model_config(path)
        if draft_cfg.vocab_size > target_cfg.vocab_size:
            raise ValueError("the draft model's vocabulary is larger than the target's: not the same tokenizer")
        return build_model(draft_cfg, path, dtype, device, max_model_len, config.random_seed, progress)

    def bytes_per_token(self, model: torch.nn.Module, dtype: torch.dtype) -> int:
        return kv_bytes_per_token(model.config, dtype)

    def target_scratch_slots(self, config: EngineConfig, device: torch.device, max_bs: int) -> int:
        return 0

    def needs_pad_page(self, config: EngineConfig, device: torch.device) -> bool:
        return False

    def build(self, config: EngineConfig, model: torch.nn.Module, target: torch.nn.Module, kv_cache: torch.Tensor,
              num_slots: int, max_bs: int, max_model_len: int, rng: random.Random, capture: bool,
              progress: bool) -> Speculator:
        spec = config.spec
        scratch = config.scheduler.max_running_requests * scratch_slots(spec.eagle_topk, spec.num_steps,
                                                                        spec.max_drafts)
        kv = allocate_kv_cache(model.config, num_slots + scratch, kv_cache.dtype, kv_cache.device)
        drafter = DraftModelDrafter(model, kv, kv_cache.device)
        proposer = TreeProposer(drafter, spec.eagle_topk, spec.num_steps, spec.max_drafts, num_slots,
                                kv_cache.device, spec.tree_sizes, max(spec.chain_lengths, default=0))
        return Speculator(proposer)
