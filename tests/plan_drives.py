"""Drives a draft plan (speculative/plan.py) through pure decode steps on a fake clock: the plan's shape
choice tested against a cost model, with no engine."""
from __future__ import annotations

import random
from typing import Callable


def drive_plan(plan, requests, accept: Callable, depth: Callable[[int], int], step_cost: Callable[[int, int], float],
               steps: int = 3000, seed: int = 0) -> tuple[float, list[int]]:
    """`steps` pure decode steps of `requests`. A request drafting k accepts position j (all before it accepted)
    with chance accept(request, k, j), up to depth(k) positions; a step costs step_cost(batch, deepest k), 0 for
    a plain step. Returns tokens per second and each step's deepest k."""
    rng = random.Random(seed)
    tokens, seconds, shapes = 0.0, 0.0, []
    for _ in range(steps):
        drafts = plan.step_drafts(requests)
        chosen = [plan.num_drafts(r) if drafts else 0 for r in requests]
        for request, k in zip(requests, chosen):
            accepted = 0
            while accepted < depth(k) and rng.random() < accept(request, k, accepted):
                accepted += 1
            if k:
                request.num_spec_steps += 1
                request.num_accepted_tokens += accepted
                plan.observe_acceptance(request, k, accepted)
            tokens += 1 + accepted
        deepest = max(chosen)
        cost = step_cost(len(requests), deepest)
        plan.observe_step(deepest > 0, len(requests), cost)
        seconds += cost
        shapes.append(deepest)
    return tokens / seconds, shapes
