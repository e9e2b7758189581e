"""The drafter interface the tree search drives, and what drafters share: catching up in bounded passes.

The drafters: an EAGLE-3 head on the target (drafters/eagle3.py) and a standalone draft model
(drafters/draft_model.py).

Both keep a KV pool that mirrors the target's pages, plus a scratch region for the tree search. Both extend
their KV over prompt chunks in the step that computes them (and over decoding requests' tokens in steps that
pending prompts keep from drafting), and otherwise catch up lazily: a request that has not drafted for a while
keeps no draft state up to date, and the next step that drafts for it first computes what was missed, in one
batched forward. So a decode step that drafts nothing costs nothing extra (the EAGLE-3 head only stores the
target's projected taps, one row per token).
"""
from __future__ import annotations

from typing import Protocol

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


def catch_up_meta(chunks: list[tuple[list[int], int]], seqs: list[ScheduledSeq], page_size: int, device):
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


class Drafter(Protocol):
    """One draft network, as the tree search sees it."""

    kv_cache: torch.Tensor
    # 1 if the network at position j reads token j+1 (EAGLE: hidden state of j, embedding of j+1), else 0.
    shift: int
    capture_layers: tuple[int, ...]

    def catch_up(self, seqs: list[ScheduledSeq], page_size: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Computes the drafter's KV up to each root; returns logits for the token after the root, and the
        state a child of the root is fed with (None if the drafter keeps no state)."""

    def extend(self, tokens: torch.Tensor, states: torch.Tensor | None, positions: torch.Tensor,
               meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feeds draft nodes (target ids); returns logits after each and the state its children are fed with."""

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor: ...

    def observe(self, captured: list[torch.Tensor], slot_mapping: torch.Tensor) -> None: ...

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None: ...
