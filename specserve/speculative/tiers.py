"""SGLang's adaptive speculation, kept as a baseline for the goodput plan (speculative/plan.py). Pure Python.

The batch size picks a tier, and the tier the draft steps a step may take:

    batch  1-7: 1, 3, 5 or 7      batch 8-31: 0, 1 or 3      batch 32-63: 0 or 1      batch 64+: 0

Within a tier an exponential moving average of the acceptance rate (accepted drafts over the chain's depth,
weight 0.2 per drafting request) picks the candidate at its rank: a rate of 1 the deepest, 0 the shallowest.
Every request of a step drafts the same shape. Steps are capped at the server's configured depth; on a tree
server (top-k > 1) a step at that depth or deeper drafts the configured tree, and fewer steps a chain of them.
No step cost is measured: the tiers stand in for costs, as they do in SGLang.
"""
from __future__ import annotations

from specserve.config import SGLANG_TIER_STEPS
from specserve.core import Request

# (smallest batch, the draft steps it may take), by growing batch.
TIERS = ((1, SGLANG_TIER_STEPS), (8, (0, 1, 3)), (32, (0, 1)), (64, (0,)))


class SglangTiers:
    """The same calls as AdaptivePlan: `step_drafts` per pure decode step, `num_drafts` per request,
    `drafting_pays` in steps with prompts; the engine reports to the `observe_*` methods."""

    def __init__(self, depth: int, full_drafts: int, alpha: float = 0.2) -> None:
        self.depth = depth  # the configured chain depth (a tree's steps)
        self.full_drafts = full_drafts  # the drafts of the configured shape: a chain's depth, a tree's budget
        self.alpha = alpha
        self.accept_rate = 1.0  # optimistic, as a fresh server drafts deep
        self.drafts = 0  # what this step's requests draft

    def candidates(self, batch_size: int) -> tuple[int, ...]:
        """The tier's draft steps, capped at the configured depth."""
        steps = [s for low, s in TIERS if batch_size >= low][-1]
        return tuple(sorted({min(s, self.depth) for s in steps}))

    def steps_for(self, batch_size: int) -> int:
        options = self.candidates(batch_size)
        return options[round(self.accept_rate * (len(options) - 1))]

    def shape_drafts(self, steps: int) -> int:
        """Drafts of a step of `steps`: the configured shape at its depth, else a chain."""
        return self.full_drafts if steps >= self.depth else steps

    def step_drafts(self, requests: list[Request]) -> bool:
        self.drafts = self.shape_drafts(self.steps_for(len(requests)))
        return self.drafts > 0

    def num_drafts(self, request: Request) -> int:
        return self.drafts

    def drafting_pays(self, requests: list[Request]) -> bool:
        return bool(requests) and self.steps_for(len(requests)) > 0

    def observe_step(self, drafted: bool, batch_size: int, seconds: float) -> None:
        pass  # the tiers stand in for step costs

    def observe_other_step(self) -> None:
        pass

    def observe_acceptance(self, request: Request, drafted: int, accepted: int, depth: int | None = None) -> None:
        """Only full drafts of the step's shape count: fewer were cut by the room the request had left. (Its
        trees are never pruned, so `depth` is the shape's.)"""
        if drafted > 0 and drafted == self.drafts:
            rate = accepted / min(drafted, self.depth)
            self.accept_rate = (1 - self.alpha) * self.accept_rate + self.alpha * rate

    def snapshot(self) -> dict:
        return {"accept_rate_ema": round(self.accept_rate, 3), "drafts": self.drafts}
