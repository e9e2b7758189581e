"""Proposers draft tokens for the sequences of one step. The runner calls them; they never call back.

`propose(batch) -> {sequence index: DraftTree}` for every sequence with `num_draft_tokens > 0`, rooted at the
sequence's last token, with `num_draft_tokens` drafts. Drafts are chosen deterministically (argmax), which is
what makes `spec.verify` lossless for them.
"""
from __future__ import annotations

from typing import Protocol

import torch

from specserve.engine.scheduler import ScheduledSeq, StepBatch
from specserve.layers.attention import AttentionMetadata
from specserve.spec.tree import DraftTree


class Proposer(Protocol):
    def propose(self, batch: StepBatch) -> dict[int, DraftTree]: ...


class DraftModelProposer:
    """A smaller causal LM with the target's tokenizer, drafting a chain greedily.

    Its KV pool mirrors the target's page layout (same page ids, its own tensors), so it needs no pages of
    its own: position p of a request lives at the same slot in both pools. Each step it first catches up on
    the tokens it has not seen (after a step without drafting, or the last accepted tokens), then runs one
    token per sequence per draft position.
    """

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, device: torch.device) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = device

    @torch.inference_mode()
    def propose(self, batch: StepBatch) -> dict[int, DraftTree]:
        spec = [(i, s) for i, s in enumerate(batch.seqs) if s.num_draft_tokens > 0]
        if not spec:
            return {}
        chunks = [(s.draft_catchup_ids, s.draft_start_pos) for _, s in spec]
        next_tokens = self._forward_last(chunks, [s for _, s in spec], batch.page_size)
        drafts = {i: [t] for (i, _), t in zip(spec, next_tokens)}
        for depth in range(1, max(s.num_draft_tokens for _, s in spec)):
            active = [(i, s) for i, s in spec if s.num_draft_tokens > depth]
            chunks = [([drafts[i][-1]], s.start_pos + depth) for i, s in active]
            for (i, _), t in zip(active, self._forward_last(chunks, [s for _, s in active], batch.page_size)):
                drafts[i].append(t)
        return {i: DraftTree.chain(s.token_ids[-1], drafts[i]) for i, s in spec}

    def _forward_last(self, chunks: list[tuple[list[int], int]], seqs: list[ScheduledSeq], page_size: int) -> list[int]:
        """Runs each (tokens, start position) chunk and returns the argmax after its last token."""
        input_ids = torch.tensor([t for ids, _ in chunks for t in ids], device=self.device)
        positions = torch.cat([torch.arange(p, p + len(ids)) for ids, p in chunks]).to(self.device)
        meta = AttentionMetadata.build(
            [len(ids) for ids, _ in chunks], [p for _, p in chunks], [s.page_ids for s in seqs], page_size, self.device
        )
        hidden, _ = self.model(input_ids, positions, meta, self.kv_cache)
        last = torch.tensor([len(ids) for ids, _ in chunks]).cumsum(0) - 1
        return self.model.compute_logits(hidden[last.to(self.device)]).argmax(dim=-1).tolist()
