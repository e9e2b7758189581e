"""Per-row logit adjustments from a request's settings and its tokens so far: logit_bias, then the repetition,
frequency and presence penalties, in vLLM's order and with its meaning (repetition over prompt and output, HF's
form; frequency and presence over the output only).

Every logit row a request samples or verifies from goes through `adjust_logits` with the tokens that precede
that row: for a draft-tree node, the request's output plus the drafts on the path to it. Verification then
judges each draft by the distribution plain decoding would have had at that position, so speculation stays
lossless (and greedy output equal to greedy without it) under penalties.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.core import SamplingParams, ScheduledSeq
from specserve.transfer import tensor_on


@dataclass(frozen=True)
class RowContext:
    """What one logit row's adjustment depends on."""

    params: SamplingParams
    prompt: Sequence[int]
    output: Sequence[int]  # output tokens before the one this row predicts


def seq_context(seq: ScheduledSeq, drafts: Sequence[int] = ()) -> RowContext | None:
    """The context of the row after `seq`'s last token, followed by `drafts` (a draft-tree path), or None
    where the request's settings adjust nothing."""
    if not seq.params.adjusts_logits:
        return None
    known = seq.history[: seq.start_pos + len(seq.token_ids)]
    return RowContext(seq.params, known[: seq.num_prompt_tokens], [*known[seq.num_prompt_tokens:], *drafts])


def adjust_logits(logits: torch.Tensor, contexts: Sequence[RowContext | None]) -> torch.Tensor:
    """logits [N, V] -> the adjusted rows (a new tensor; rows whose context is None unchanged)."""
    rows = [i for i, c in enumerate(contexts) if c is not None]
    if not rows:
        return logits
    picked = [contexts[i] for i in rows]
    vocab = logits.shape[-1]
    adjusted = logits[rows].float()
    _add_bias(adjusted, picked)
    output_counts = _counts([c.output for c in picked], vocab, adjusted.device)
    if any(c.params.repetition_penalty != 1.0 for c in picked):
        seen = (output_counts + _counts([c.prompt for c in picked], vocab, adjusted.device)) > 0
        penalty = tensor_on([c.params.repetition_penalty for c in picked], adjusted.device)[:, None]
        adjusted = torch.where(seen, torch.where(adjusted > 0, adjusted / penalty, adjusted * penalty), adjusted)
    frequency = tensor_on([c.params.frequency_penalty for c in picked], adjusted.device)[:, None]
    presence = tensor_on([c.params.presence_penalty for c in picked], adjusted.device)[:, None]
    adjusted = adjusted - frequency * output_counts - presence * (output_counts > 0)
    out = logits.float().clone()
    out[rows] = adjusted
    return out


def _add_bias(logits: torch.Tensor, contexts: list[RowContext]) -> None:
    pairs = [(row, token, bias) for row, c in enumerate(contexts) for token, bias in c.params.logit_bias]
    if not pairs:
        return
    rows, tokens, biases = zip(*pairs)
    index = tensor_on(rows, logits.device) * logits.shape[-1] + tensor_on(tokens, logits.device)
    logits.view(-1).index_add_(0, index, tensor_on(biases, logits.device).to(logits.dtype))


def _counts(token_lists: list[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab]: how often each token occurs in each list."""
    flat = [row * vocab + t for row, tokens in enumerate(token_lists) for t in tokens]
    if not flat:
        return torch.zeros(len(token_lists), vocab, device=device)
    counts = torch.bincount(tensor_on(flat, device), minlength=len(token_lists) * vocab)
    return counts.view(len(token_lists), vocab).float()
