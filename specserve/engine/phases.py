"""Where a step's time goes: schedule, draft (the general search, its catch-up included), catch_up (the step
programs' backlog pass), prepare, forward, follow (the draft head extending over tokens of steps without
drafts), sample/verify, postprocess; and
how the steps' time splits between kinds of step (prompt work, plain decode, drafting decode). A step's time
runs from the read-back of the step before to its own read-back. Under overlap scheduling the host reads a
step back while the next one is queued, so that is the time the device took for it; timed from one step's
start to the next's instead, each step would carry the one before it (the first decode step after a prompt
step, that prompt step's device time). A step that samples nothing (prompt chunks alone) is not waited for,
so its device time lands in the next step read back.

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
        # kind -> [steps, seconds], each step timed from the read-back before it to its own
        self.kinds: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
        self._last_read: float | None = None

    def step_started(self) -> None:
        """The first step's start is where the first step's time begins."""
        if self._last_read is None:
            self._last_read = time.perf_counter()

    def step_read(self, kind: str) -> None:
        """A step of `kind` was read back (its tokens are on the host)."""
        now = time.perf_counter()
        entry = self.kinds[kind]
        entry[0] += 1
        entry[1] += now - (self._last_read if self._last_read is not None else now)
        self._last_read = now

    def stop(self) -> None:
        """Ends the run: a later step starts timing afresh."""
        self._last_read = None

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

    def step_started(self) -> None:
        pass

    def step_read(self, kind: str) -> None:
        pass

    def stop(self) -> None:
        pass

    def phase(self, name: str):
        return nullcontext()
