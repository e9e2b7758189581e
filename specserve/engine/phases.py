"""Where a step's time goes: schedule, draft, prepare, forward, sample/verify, postprocess.

Off by default (a no-op). The offline benchmark switches it on; on a GPU it then synchronises at each phase
boundary so device time lands in the phase that queued it, which makes the step itself a little slower.
"""
from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext

import torch

# Phases in which the device waits for the host when nothing overlaps them.
HOST_ONLY_PHASES = ("schedule", "prepare", "postprocess")


class PhaseTimer:
    def __init__(self, device: torch.device) -> None:
        self.sync = device.type == "cuda"
        self.totals: dict[str, float] = defaultdict(float)
        self.steps = 0

    @contextmanager
    def phase(self, name: str):
        if self.sync:
            torch.cuda.synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync:
                torch.cuda.synchronize()
            self.totals[name] += time.perf_counter() - start

    def per_step_ms(self) -> dict[str, float]:
        steps = max(self.steps, 1)
        ms = {name: 1e3 * total / steps for name, total in self.totals.items()}
        ms["host_only"] = sum(ms.get(name, 0.0) for name in HOST_ONLY_PHASES)
        return ms


class NoTimer:
    steps = 0

    def phase(self, name: str):
        return nullcontext()
