"""Token sampling for a batch of rows with per-row settings.

Greedy rows take the argmax. Other rows are filtered (top-k, top-p, min-p) and then drawn with the
exponential race (argmax of p / E with E ~ Exp(1)), which is an exact draw from p and needs no
host-side branching. Rows with a seed draw their noise from their own generator.
"""
from __future__ import annotations

import torch

from specserve.core import SamplingParams
from specserve.transfer import tensor_on


def sample(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int | None]) -> torch.Tensor:
    """logits [N, V] -> token ids [N]."""
    greedy = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy
    probs = filtered_probs(logits, params)
    drawn = race(probs, _exponential_noise(probs, seeds))
    is_greedy = tensor_on([p.greedy for p in params], logits.device)
    return torch.where(is_greedy, greedy, drawn)


def argmax(logits: torch.Tensor, offsets: torch.Tensor | None = None, out: torch.Tensor | None = None
           ) -> torch.Tensor:
    """The greedy token of each row: argmax over the last dimension, plus offsets[argmax] where `offsets` is
    given (an EAGLE-3 head's draft-to-target id map); written into `out` where given (int64: one dimension with
    any stride, or contiguous). On a GPU two small Triton kernels (kernels/triton/argmax.py) take the place of
    torch.argmax, which takes many times a row's reading time on a large vocabulary, and add the offsets too;
    the graphs of decode and speculative steps use it."""
    if logits.is_cuda:
        from specserve.kernels.triton import argmax as triton_argmax  # Triton: GPU machines only

        if triton_argmax.supports(logits):
            return triton_argmax.argmax(logits, offsets, out)
    best = logits.argmax(dim=-1)
    best = best if offsets is None else best + offsets[best]
    return best if out is None else out.copy_(best)


def race(weights: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
    """One draw per row [N] from weights [N, V] (any scale): the exponential race, argmax of w / E with
    E ~ Exp(1), fresh unless `noise` is given."""
    noise = torch.empty_like(weights).exponential_() if noise is None else noise
    return (weights / noise).argmax(dim=-1)


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution each row samples from: softmax(logits / T) restricted by top-k, top-p and min-p."""
    device = logits.device
    temps = tensor_on([p.temperature if p.temperature > 0 else 1.0 for p in params], device)
    probs = torch.softmax(logits.float() / temps[:, None], dim=-1)
    top_k = [p.top_k if p.top_k > 0 else logits.shape[-1] for p in params]
    top_p = [p.top_p for p in params]
    min_p = [p.min_p for p in params]
    if any(k < logits.shape[-1] for k in top_k) or any(p < 1.0 for p in top_p):
        probs = _top_k_top_p(probs, tensor_on(top_k, device), tensor_on(top_p, device))
    if any(m > 0 for m in min_p):
        floor = tensor_on(min_p, device)[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def _top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)[None, :]
    sorted_probs = sorted_probs.masked_fill(rank >= top_k[:, None], 0.0)
    # Top-p acts on what top-k left, renormalised (as HF's warpers chain): keep a token while the
    # mass ranked above it is still below top_p.
    sorted_probs = sorted_probs / sorted_probs.sum(dim=-1, keepdim=True)
    mass_above = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_above >= top_p[:, None], 0.0)
    return torch.zeros_like(probs).scatter_(-1, order, sorted_probs)


def _exponential_noise(probs: torch.Tensor, seeds: list[int | None]) -> torch.Tensor:
    noise = torch.empty_like(probs).exponential_()
    for row, seed in enumerate(seeds):
        if seed is not None:
            generator = torch.Generator(device=probs.device).manual_seed(seed)
            noise[row].exponential_(generator=generator)
    return noise
