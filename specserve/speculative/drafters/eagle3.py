"""The EAGLE-3 drafter: a head that reads the target's tapped layers and drafts from them."""
from __future__ import annotations

import random
from pathlib import Path

import torch

from specserve import envs
from specserve.config import EngineConfig, ModelConfig
from specserve.core import ScheduledSeq
from specserve.kv.pool import allocate_kv_cache, kv_bytes_per_token
from specserve.models.loader import load_eagle3_head
from specserve.speculative.base import Speculator
from specserve.speculative.drafters.base import catch_up_meta, eagle3_catch_up, split_catch_up
from specserve.speculative.programs.base import ProgramSetup
from specserve.speculative.programs.chain import ChainGraphs
from specserve.speculative.programs.shapes import ShapePrograms
from specserve.speculative.programs.tree import TreeGraphs
from specserve.speculative.search import TreeProposer, scratch_slots

# A random head drafts over 32k tokens, the draft vocabulary of public Llama-3 EAGLE-3 heads. Its logits get a
# spread (std 10) at which its top choice holds ~70 % of the probability, as a trained head's often does;
# near-uniform drafts would keep EAGLE-2's best nodes within two levels, so a simulated acceptance length could
# never reach the depths trees are built for. Costs do not change.
RANDOM_HEAD_VOCAB = 32000
RANDOM_HEAD_LOGIT_STD = 10.0


class Eagle3Drafter:
    """An EAGLE-3 head. At position j it reads the target's taps at j (projected by `fc`) and the embedding of
    token j+1, and predicts token j+2; fed back, it reads its own output in place of the taps.

    `taps` holds the projected taps of every token the target computed, at that token's KV slot, so catching
    up needs no extra target work.
    """

    shift = 1

    def __init__(self, head: torch.nn.Module, embed: torch.nn.Module, kv_cache: torch.Tensor, taps: torch.Tensor,
                 device: torch.device) -> None:
        self.head = head
        self.embed = embed
        self.kv_cache = kv_cache
        self.taps = taps
        self.device = device
        self.capture_layers = head.config.target_layers
        self.attention_config = head.config.model

    def observe(self, captured: list[torch.Tensor], slot_mapping: torch.Tensor) -> None:
        self.taps.index_copy_(0, slot_mapping, self.head.project_taps(captured).to(self.taps.dtype))

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.taps[dst] = self.taps[src]

    def catch_up(self, seqs: list[ScheduledSeq], page_size: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Rows for the sequences with tokens to feed: every drafting one has. A one-token prompt has none until
        its first output (position 0 pairs the taps of token 0 with token 1), and is left out."""
        chunks = [eagle3_catch_up(s) for s in seqs]
        seqs = [s for s, (ids, _) in zip(seqs, chunks) if ids]
        if not seqs:
            return None, None
        passes, chunks = split_catch_up([chunk for chunk in chunks if chunk[0]])
        for pieces in passes:
            self._extend_over([(ids, p) for _, ids, p in pieces], [seqs[b] for b, _, _ in pieces], page_size)
        out, last = self._extend_over(chunks, seqs, page_size)
        return self.head.compute_logits(out[last]), out[last]

    def _extend_over(self, chunks, seqs, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over (tokens, first position) chunks, one per sequence: its outputs, and each chunk's last row."""
        input_ids, positions, meta, last = catch_up_meta(chunks, seqs, page_size, self.device)
        hidden = self.taps[meta.slot_mapping]
        return self.head(self.embed(input_ids), hidden, positions, meta, self.kv_cache), last

    def extend(self, tokens, states, positions, meta) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.head(self.embed(tokens), states, positions, meta, self.kv_cache)
        return self.head.compute_logits(out), out

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.to_target_ids(ids)


class Eagle3:
    """`--speculative-algorithm EAGLE3`: a head in the public EAGLE-3 format. Chains (top-k 1) run as the chain
    program, trees as the tree program on a GPU; the general search takes what they do not fit."""

    def load(self, config: EngineConfig, target_cfg: ModelConfig, dtype, device, max_model_len: int,
             progress: bool) -> torch.nn.Module:
        spec = config.spec
        path = None if spec.draft_model_path is None else Path(spec.draft_model_path).expanduser()
        if path is not None and not (path / "config.json").exists():
            raise FileNotFoundError(f"no config.json in the draft model path {path}")
        if path is None and config.load_format != "dummy":
            raise ValueError("--speculative-draft-model-path is required for EAGLE3 (a random head needs "
                             "--load-format dummy)")
        head = load_eagle3_head(path, target_cfg, dtype, device, max_model_len, config.random_seed,
                                draft_vocab_size=None if path else min(RANDOM_HEAD_VOCAB, target_cfg.vocab_size),
                                logit_std=None if path else RANDOM_HEAD_LOGIT_STD,
                                quantization=spec.draft_model_quantization)
        too_wide = head.d2t.max() + head.config.draft_vocab_size > target_cfg.vocab_size
        if head.config.target_hidden_size != target_cfg.hidden_size or too_wide:
            raise ValueError("the EAGLE-3 head does not match the target: hidden size or vocabulary differ")
        return head

    def bytes_per_token(self, head: torch.nn.Module, dtype: torch.dtype) -> int:
        """One layer of KV, plus the projected target taps kept for catching up."""
        hidden = head.config.model.hidden_size
        return kv_bytes_per_token(head.config.model, dtype) + hidden * torch.empty((), dtype=dtype).element_size()

    def target_scratch_slots(self, config: EngineConfig, device: torch.device, max_bs: int) -> int:
        """Tree programs verify their nodes in scratch slots after the target's pages."""
        return max_bs * config.spec.max_drafts if self._tree_program(config, device) else 0

    def needs_pad_page(self, config: EngineConfig, device: torch.device) -> bool:
        """Step programs write padded rows' KV to a page no request owns."""
        return bool(config.spec.chain_lengths) or self._tree_program(config, device)

    def build(self, config: EngineConfig, head: torch.nn.Module, target: torch.nn.Module, kv_cache: torch.Tensor,
              num_slots: int, max_bs: int, max_model_len: int, rng: random.Random, capture: bool,
              progress: bool) -> Speculator:
        """`num_slots`: the target's page slots; its padding page follows them, then the tree's scratch."""
        spec, dtype, device = config.spec, kv_cache.dtype, kv_cache.device
        page_size = config.cache.page_size
        scratch = config.scheduler.max_running_requests * scratch_slots(spec.eagle_topk, spec.num_steps,
                                                                        spec.max_drafts)
        # The slot after the mirrored ones (also the first scratch slot) takes padded rows' KV in graphs.
        head_kv = allocate_kv_cache(head.config.model, num_slots + scratch + 1, dtype, device)
        # One row per target KV slot, the graphs' padding slot included.
        taps = torch.zeros(kv_cache.shape[2], head.config.model.hidden_size, dtype=dtype, device=device)
        drafter = Eagle3Drafter(head, target.embed_tokens, head_kv, taps, device)
        proposer = TreeProposer(drafter, spec.eagle_topk, spec.num_steps, spec.max_drafts, num_slots, device,
                                spec.tree_sizes, max(spec.chain_lengths, default=0))
        setup = ProgramSetup(num_slots, max_bs, max_model_len, page_size, spec.simulate_accept_len, rng, capture,
                             progress)
        trees = {}
        if self._tree_program(config, device):
            # The target's scratch starts after its padding page, the head's after its padding slot. Every
            # tree size uses the start of the configured one's: a step runs one program, and its nodes are
            # moved out of scratch within the step.
            scratch = (num_slots + page_size, num_slots + 1)
            trees = {drafts: TreeGraphs(target, drafter, kv_cache, spec.eagle_topk, levels, drafts, scratch, setup)
                     for drafts, levels in spec.tree_sizes}
        chains = {k: ChainGraphs(target, drafter, kv_cache, k, setup) for k in spec.chain_lengths}
        if len(chains) + len(trees) > 1:  # the draft plan picks among shapes
            return Speculator(proposer, ShapePrograms(chains, trees))
        return Speculator(proposer, next(iter(trees.values()), None) or next(iter(chains.values()), None))

    @staticmethod
    def _tree_program(config: EngineConfig, device: torch.device) -> bool:
        return config.spec.eagle_topk > 1 and (device.type == "cuda" or envs.get().tree_program_on_cpu)
