"""Tokens that a step has sampled on the device but the host has not read yet (overlap scheduling).

With overlap, step N+1 is scheduled and launched before step N's tokens are read back, so a decoding request's
next input is not known on the host. It is written as a placeholder, a negative id naming a slot of a small
device buffer that step N's sampler fills; the runner swaps placeholders for the real ids on the device, just
before step N+1's forward, so the host never waits. Stream order alone keeps step N+1 from reading a slot
before step N writes it. Two halves alternate between steps so that step N's values survive step N+1's
launch: if that launch fails after publishing, the one-by-one retry still resolves step N's placeholders.
"""
from __future__ import annotations

import torch


class FutureTokens:
    def __init__(self, capacity: int, device: torch.device) -> None:
        self.capacity = capacity
        self.values = torch.zeros(2 * capacity, dtype=torch.long, device=device)
        self._half = 0

    def publish(self, tokens: torch.Tensor) -> list[int]:
        """Stores a step's sampled tokens [n] on the device; returns their placeholders."""
        placeholders = self.reserve(tokens.numel())
        self.store(placeholders, tokens)
        return placeholders

    def reserve(self, n: int) -> list[int]:
        """Placeholders for a step's n tokens, to be `store`d before any later step reads them: a step
        whose sampling waits for its grammar masks hands them out at launch."""
        if n > self.capacity:
            raise ValueError(f"{n} sampled tokens exceed the future buffer's {self.capacity}")
        base = self._half * self.capacity
        self._half ^= 1
        return [-(base + i + 1) for i in range(n)]

    def store(self, placeholders: list[int], tokens: torch.Tensor) -> None:
        if placeholders:
            base = -placeholders[0] - 1
            self.values[base:base + len(placeholders)] = tokens

    def resolve(self, ids: torch.Tensor) -> None:
        """Replaces placeholders in `ids` (a device tensor) by the tokens they stand for, in place."""
        if ids.is_cuda and ids.dim() == 1 and ids.is_contiguous():
            from specserve.kernels.triton.pointwise import resolve_placeholders

            if resolve_placeholders(ids, self.values):
                return
        slots = (-ids - 1).clamp_(min=0)
        ids.copy_(torch.where(ids < 0, self.values[slots], ids))


def has_placeholder(token_ids) -> bool:
    return min(token_ids, default=0) < 0
