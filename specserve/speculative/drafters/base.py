"""The two drafters behind `TreeProposer`: a standalone draft model, and an EAGLE-3 head on the target.

Both keep a KV pool that mirrors the target's pages, plus a scratch region for the tree search. Both extend
their KV over prompt chunks in the step that computes them (and over decoding requests' tokens in steps that
pending prompts keep from drafting), and otherwise catch up lazily: a request that has not drafted for a while
keeps no draft state up to date, and the next step that drafts for it first computes what was missed, in one
batched forward. So a decode step that drafts nothing costs nothing extra (the EAGLE-3 head only stores the
target's projected taps, one row per token).
"""
from __future__ import annotations

import torch

from specserve.core import ScheduledSeq
from specserve.layers.attention import AttentionMetadata
from specserve.transfer import tensor_on, to_device


# Tokens one catch-up pass feeds the drafter at most: after a long spell without drafting, a batch of
# requests may be thousands of tokens behind each, and one pass over all of it would need gigabytes of
# activations.
CATCH_UP_PASS_TOKENS = 8192


def split_catch_up(chunks: list[tuple[list[int], int]], max_tokens: int | None = None):
    """Splits (tokens, start position) chunks, one per sequence, into earlier passes and a last one.
    Returns (passes, tails): each pass a list of (sequence index, tokens, start) pieces of at most
    `max_tokens` tokens in all, a sequence's pieces in order in successive passes; and per sequence the
    piece the last pass computes (its last tokens), whose outputs the caller wants. Run in order, the passes
    leave the drafter's KV as one pass over everything would."""
    max_tokens = max_tokens or CATCH_UP_PASS_TOKENS
    if sum(len(ids) for ids, _ in chunks) <= max_tokens:
        return [], chunks
    tail_len = max(1, max_tokens // max(1, len(chunks)))
    tails = [(ids[-tail_len:], start + max(0, len(ids) - tail_len)) for ids, start in chunks]
    passes, current, room = [], [], max_tokens
    for b, (ids, start) in enumerate(chunks):
        done, prefix = 0, len(ids) - tail_len
        while done < prefix:
            take = min(room, prefix - done)
            current.append((b, ids[done:done + take], start + done))
            done, room = done + take, room - take
            if room == 0:
                passes.append(current)
                current, room = [], max_tokens
    if current:
        passes.append(current)
    return passes, tails


def _catch_up_meta(chunks: list[tuple[list[int], int]], seqs: list[ScheduledSeq], page_size: int, device):
    """Token ids, positions and attention metadata for (tokens, start position) chunks, one per sequence."""
    input_ids = tensor_on([t for ids, _ in chunks for t in ids], device)
    positions = to_device(torch.cat([torch.arange(p, p + len(ids)) for ids, p in chunks]), device)
    meta = AttentionMetadata.build(
        [len(ids) for ids, _ in chunks], [p for _, p in chunks], [s.page_ids for s in seqs], page_size, device,
        varied_shapes=True,  # catch-ups come in every length
    )
    last = to_device(torch.tensor([len(ids) for ids, _ in chunks]).cumsum(0) - 1, device)
    return input_ids, positions, meta, last


def eagle3_catch_up(seq: ScheduledSeq) -> tuple[list[int], int]:
    """The tokens an EAGLE-3 head must be fed before drafting for `seq`, and the position of the first. It
    has seen tokens [draft_start_pos, root]; position j pairs token j+1 with the taps of j, so the positions
    to compute run from draft_start_pos - 1 (never below 0) to root - 1."""
    first = max(seq.draft_start_pos - 1, 0)
    return seq.draft_catchup_ids[first + 1 - seq.draft_start_pos:], first


class DraftModelDrafter:
    """A smaller causal LM with the target's tokenizer. At position j it reads token j, like the target."""

    shift = 0
    capture_layers: tuple[int, ...] = ()

    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, device: torch.device) -> None:
        self.model = model
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
        input_ids, positions, meta, last = _catch_up_meta(chunks, seqs, page_size, self.device)
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

    def observe(self, captured: list[torch.Tensor], slot_mapping: torch.Tensor) -> None:
        self.taps.index_copy_(0, slot_mapping, self.head.project_taps(captured).to(self.taps.dtype))

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.taps[dst] = self.taps[src]

    def catch_up(self, seqs: list[ScheduledSeq], page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        passes, chunks = split_catch_up([eagle3_catch_up(s) for s in seqs])
        for pieces in passes:
            self._extend_over([(ids, p) for _, ids, p in pieces], [seqs[b] for b, _, _ in pieces], page_size)
        out, last = self._extend_over(chunks, seqs, page_size)
        return self.head.compute_logits(out[last]), out[last]

    def _extend_over(self, chunks, seqs, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over (tokens, first position) chunks, one per sequence: its outputs, and each chunk's last row."""
        input_ids, positions, meta, last = _catch_up_meta(chunks, seqs, page_size, self.device)
        hidden = self.taps[meta.slot_mapping]
        return self.head(self.embed(input_ids), hidden, positions, meta, self.kv_cache), last

    def extend(self, tokens, states, positions, meta) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.head(self.embed(tokens), states, positions, meta, self.kv_cache)
        return self.head.compute_logits(out), out

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head.to_target_ids(ids)
