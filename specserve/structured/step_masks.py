"""The grammar masks of one launched step: the one place that builds them, and that knows when.

A step holding constrained rows is run in two halves: the forward and the logits are queued on the device,
then the masks are applied and the rows sampled or verified. The masks are built on the host between the two,
so the host builds them while the device runs the forward. When they can be built depends on what the host
knows at launch:

- Eager (the grammars are current: nothing of theirs is in flight): started at launch, on a worker thread
  with `concurrent`, else in the step's own thread once the forward is queued. The worker is what lets a
  CPU "device" overlap too: the forward's tensor ops release the GIL, xgrammar's calls hold it for
  microseconds each. A step's matchers are touched by the worker alone until `result` joins it; nothing
  else reads them meanwhile (the drafter's own masks are filled before, the engine advances the grammars
  after the step is read back).
- Deferred (overlap scheduling launches a plain step before the one in flight is read back, so each grammar
  still lacks that step's token): built at `result`, which the engine calls after that read-back.

Each step records whether its masks were ready before the device finished the forward: on a GPU, a CUDA
event recorded after the forward and not yet reached when the masks are done; on a CPU, whose forward runs in
the step's own thread, the masks were done before that thread came back from it.
"""
from __future__ import annotations

import itertools
import os
import threading
from functools import partial
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")

# Below this many jobs, handing them to threads costs more than running them: most mask fills are short,
# and only a batch gathers enough of them (or a few long ones, inside length-bounded strings) to pay.
PARALLEL_MIN_JOBS = 8
_FILL_THREADS = max(1, min(8, (os.cpu_count() or 1) - 1))
_fill_pool: ThreadPoolExecutor | None = None
_fill_pool_lock = threading.Lock()


def run_jobs(jobs: Sequence[Callable[[], T]]) -> list[T]:
    """Each job's result, in order. Jobs that each touch one request's grammar run on a pool of host threads
    (xgrammar's mask fills release the GIL), so the masks of a large batch take a fraction of the time one
    thread needs; few jobs, or one host core, run in the caller's thread. Each thread takes the next job not
    yet taken: a fill inside a length-bounded string takes milliseconds where most take microseconds, and in
    fixed shares the jobs behind such a fill would wait for it."""
    if len(jobs) < PARALLEL_MIN_JOBS or _FILL_THREADS == 1:
        return [job() for job in jobs]
    global _fill_pool
    with _fill_pool_lock:
        if _fill_pool is None:
            _fill_pool = ThreadPoolExecutor(_FILL_THREADS, thread_name_prefix="grammar-fill")
    results: list = [None] * len(jobs)
    taken, failed = itertools.count(), threading.Event()
    futures = [_fill_pool.submit(_take_jobs, jobs, results, taken, failed)
               for _ in range(min(_FILL_THREADS, len(jobs)))]
    # Every thread stops before a failure is raised: a step given up must leave no thread on its grammars.
    wait(futures)
    for future in futures:
        future.result()
    return results


def _take_jobs(jobs: Sequence[Callable[[], T]], results: list, taken, failed: threading.Event) -> None:
    """Runs the next job not taken (`taken`: a shared counter) until none is left or one has failed."""
    while not failed.is_set() and (index := next(taken)) < len(jobs):
        try:
            results[index] = jobs[index]()
        except BaseException:
            failed.set()
            raise


class QueuedWork:
    """Marks what the device has been given so far; `done` says whether it has finished it (on a CPU, whose
    ops run as they are called, always)."""

    def __init__(self, device: torch.device) -> None:
        self._event = None
        if device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()

    def done(self) -> bool:
        return self._event is None or self._event.query()


@dataclass
class MaskTiming:
    """Steps with constrained rows, and those whose masks were ready before the device finished."""

    steps: int = 0
    ready_first: int = 0

    @property
    def ready_share(self) -> float | None:
        return self.ready_first / self.steps if self.steps else None

    def reset(self) -> None:
        self.steps = self.ready_first = 0


class MaskWorker:
    """One host thread that builds steps' masks; it starts on the first step that asks."""

    def __init__(self) -> None:
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    def submit(self, build: Callable[[], None]) -> Future:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return self._pool.submit(build)


class MaskJob:
    """`build` run on `worker` from now, or (without one) in the caller's thread at the first `wait`."""

    def __init__(self, build: Callable[[], None], worker: MaskWorker | None) -> None:
        self._build = build
        self._future = worker.submit(build) if worker is not None else None
        self._ran = False

    def wait(self) -> None:
        """Returns once `build` has run; re-raises what it raised."""
        if self._future is not None:
            self._future.result()
        elif not self._ran:
            self._ran = True
            self._build()

    def settle(self) -> None:
        """Waits for the worker, if it has the job in hand (a step given up), without raising."""
        if self._future is not None:
            self._future.exception()


class StepMasks:
    """Per row of the step that samples under a grammar (by sequence index): its masks, [rows, words] int32,
    one row per logit row it gets (one; or one per draft-tree node, the grammar after the drafts on the path
    to it). Build with `for_step`; mark `forward_queued` once the step's logits are queued; read `result`."""

    def __init__(self, jobs: dict[int, Callable[[], torch.Tensor]], timing: MaskTiming,
                 worker: MaskWorker | None, deferred: bool) -> None:
        self._jobs = jobs
        self._timing = timing
        self.deferred = deferred
        self._masks: dict[int, torch.Tensor] | None = None
        self._forward: QueuedWork | None = None  # marked once the forward is queued
        self._ready_first = False
        self._counted = False
        self._job = MaskJob(self._build, None if deferred else worker)

    @classmethod
    def for_step(cls, seqs: Sequence, trees: dict, timing: MaskTiming, worker: MaskWorker | None = None,
                 deferred: bool = False) -> StepMasks | None:
        """None when no sampling row is constrained. `trees`: sequence index -> its draft tree (tokens,
        parents); `worker` builds them beside the forward (eager steps only); `deferred` as above."""
        jobs = {}
        for i, seq in enumerate(seqs):
            if seq.sample and seq.grammar is not None:
                tree = trees.get(i)
                jobs[i] = (partial(_next_mask, seq.grammar) if tree is None else
                           partial(seq.grammar.tree_masks, tree.tokens, tree.parents))
        return cls(jobs, timing, worker, deferred) if jobs else None

    def forward_queued(self, device: torch.device) -> None:
        """The step's forward and logits are queued: the device is busy with them from here."""
        self._forward = QueuedWork(device)

    def result(self) -> dict[int, torch.Tensor]:
        """The masks by sequence index; the step's one wait for the host's side."""
        if not self._counted:
            self._job.wait()
            self._timing.steps += 1
            self._timing.ready_first += self._ready_first
            self._counted = True
        return self._masks

    def settle(self) -> None:
        """Waits for the worker, if it has this step's masks in hand (a failed step), without raising."""
        self._job.settle()

    def rows(self, index: int, num_rows: int) -> list[torch.Tensor | None]:
        """Sequence `index`'s masks as one [1, words] tensor per logit row (None per row if unconstrained),
        for sampling/grammar_mask.mask_logits."""
        masks = self.result().get(index)
        return [None] * num_rows if masks is None else list(masks.split(1))

    def _build(self) -> None:
        self._masks = dict(zip(self._jobs, run_jobs(list(self._jobs.values()))))
        self._ready_first = not self._device_done()

    def _device_done(self) -> bool:
        # Not yet marked: still being queued (or, on a CPU, still running).
        return self._forward is not None and self._forward.done()


def _next_mask(grammar) -> torch.Tensor:
    """A deferred step's row may belong to a request whose grammar ended on the token just read back: its
    token is dropped, so any mask does, and xgrammar has none past the end."""
    return grammar.empty_masks(1) if grammar.terminated else grammar.next_mask()
