"""Where a step's time goes: schedule, draft (the general search, its catch-up included), catch_up (the step
programs' backlog pass), prepare, forward, follow (the draft head extending over tokens of steps without
drafts), sample/verify, postprocess; and
how the steps' time splits between kinds of step (prompt work, plain decode, drafting decode).

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
        # kind -> [steps, seconds], each step timed from its start to the next step's start
        self.kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        self._open: tuple[str, float] | None = None

    def step_started(self, batch) -> None:
        """Closes the step before (its time runs to this start) and opens `batch`'s (a StepBatch)."""
        now = time.perf_counter()
        self.stop()
        self._open = (batch.kind, now)

    def stop(self) -> None:
        """Closes the open step: after the last one, when the run ends."""
        if self._open is not None:
            kind, start = self._open
            entry = self.kinds[kind]
            entry[0] += 1
            entry[1] += time.perf_counter() - start
            self._open = None

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

    def step_kinds(self) -> dict[str, dict[str, float]]:
        """Per kind of step: how many, their total seconds and mean milliseconds."""
        return {kind: {"steps": int(n), "seconds": total, "mean_ms": 1e3 * total / n}
                for kind, (n, total) in sorted(self.kinds.items()) if n}


class NoTimer:
    steps = 0

    def step_started(self, batch) -> None:
        pass

    def stop(self) -> None:
        pass

    def phase(self, name: str):
        return nullcontext()
