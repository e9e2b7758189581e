"""Grammar masks on logit rows: the one place a constrained request's forbidden tokens get -inf.

Every constrained logit row goes through `mask_logits` after penalties and bias (sampling/penalties.py) and
before sampling or verification: plain sampling and greedy alike, each node of a draft tree (with the grammar
state after the drafts on its path), and the draft head's own rows while it searches (`allowed_tokens`, read
through its draft-to-target map). The constrained target distribution is then the masked one for plain and
speculative decoding alike, which keeps verification lossless: a draft the grammar forbids gets no mass from
its parent's row and is rejected like any other unlikely draft.

Masks are int32 bitmasks (bit j of word w allows token 32 w + j), as structured/state.py fills them.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

# Bit j of byte b, for every byte value: unpacking a bitmask is one table lookup per byte. The masks' int32
# words are read as little-endian bytes, so byte k of word w holds tokens 32 w + 8 k .. 32 w + 8 k + 7.
_BYTE_BITS = (torch.arange(256)[:, None] >> torch.arange(8)) & 1 == 1
_tables: dict[tuple[torch.device, bool], torch.Tensor] = {}


def allowed_tokens(masks: torch.Tensor, vocab_size: int, device: torch.device | None = None,
                   forbidden: bool = False) -> torch.Tensor:
    """[N, words] int32 bitmasks -> [N, vocab_size] bool: allowed tokens (with `forbidden`, the others)."""
    device = device or masks.device
    table = _tables.get((device, forbidden))
    if table is None:
        table = _tables[device, forbidden] = (~_BYTE_BITS if forbidden else _BYTE_BITS).to(device)
    as_bytes = masks.contiguous().view(torch.uint8)
    if device.type == "cuda" and not as_bytes.is_cuda:
        # From pinned memory the copy is queued behind the step's forward without holding the host there,
        # which a copy from pageable memory does (masks of a plain step are applied behind its forward).
        as_bytes = as_bytes.pin_memory().to(device, non_blocking=True)
    else:
        as_bytes = as_bytes.to(device)
    return table[as_bytes.int()].view(masks.shape[0], -1)[:, :vocab_size]


def allowed_drafts(masks: torch.Tensor, draft_to_target: torch.Tensor) -> torch.Tensor:
    """[N, words] int32 bitmasks over the target's vocabulary -> [N, draft vocabulary] bool, read through each
    draft id's target id. A row that allows none of the drafter's tokens allows them all: its drafts are wasted
    either way, and a row with nothing allowed has no log-softmax."""
    allowed = allowed_tokens(masks, 32 * masks.shape[1], draft_to_target.device)[:, draft_to_target]
    allowed |= ~allowed.any(dim=1, keepdim=True)
    return allowed


def mask_logits(logits: torch.Tensor, masks: Sequence[torch.Tensor | None]) -> torch.Tensor:
    """logits [N, V] and one [1, words] or None (unconstrained) per row -> the rows with forbidden tokens at
    -inf (a new tensor; the input itself when no row is constrained)."""
    if all(m is None for m in masks):
        return logits
    words = next(m for m in masks if m is not None).shape[-1]
    every = torch.full((1, words), -1, dtype=torch.int32)
    forbidden = allowed_tokens(torch.cat([every if m is None else m for m in masks]), logits.shape[-1],
                               logits.device, forbidden=True)
    return logits.masked_fill(forbidden, float("-inf"))
