"""One step program per draft shape a draft plan may pick (speculative/plan.py, tiers.py).

A chain program's cost follows its depth k (k draft passes, k + 1 verified rows per sequence), whatever each
row's own limit, so a plan that picks shorter chains needs a program of each depth. A step runs the program of
its deepest row: rows asking fewer drafts ride along with their own limits (the rows past a limit write to the
padding slot and are never accepted). On a tree server, a row asking more drafts than the deepest chain takes
the program of the smallest tree size that holds it (SpecConfig.tree_sizes: the configured tree and, under the
goodput policy, smaller ones), or, where there is none, the general search. A tree program's cost follows its
budget and levels likewise, whatever each row's limit. Each program captures its own CUDA graphs, so every
shape the plan can pick is covered.

A step that follows the last launch on the device (`Scheduler.follow`) continues its program; the scheduler
builds one only after a step of the configured shape.
"""
from __future__ import annotations

import torch

from specserve.core import StepBatch


class ShapePrograms:
    """Chains of several depths and, on a tree server, trees of a few sizes: the runner sees one StepProgram."""

    def __init__(self, chains: dict, trees: dict | None = None) -> None:
        self.chains = dict(sorted(chains.items()))  # depth -> ChainGraphs
        self.trees = dict(sorted((trees or {}).items()))  # drafts -> TreeGraphs, the configured tree last
        # The program launched last: its width is what the runner reports, and what a following step continues.
        self.last = self.trees[max(self.trees)] if self.trees else self.chains[max(self.chains)]
        self.width = self.last.width

    def _pick(self, batch: StepBatch):
        if batch.follow is not None:
            return self.last
        deepest = max(s.num_draft_tokens for s in batch.seqs)
        if self.chains and deepest <= max(self.chains):
            return next(chain for depth, chain in self.chains.items() if depth >= deepest)
        return next((tree for drafts, tree in self.trees.items() if drafts >= deepest), None)

    def fits(self, batch: StepBatch) -> bool:
        if not batch.seqs:
            return False
        program = self._pick(batch)
        return program is not None and program.fits(batch)

    @torch.inference_mode()
    def launch(self, batch: StepBatch, timer) -> torch.Tensor:
        program = self._pick(batch)
        self.last, self.width = program, program.width
        return program.launch(batch, timer)

    @property
    def last_packed(self) -> torch.Tensor:
        """What the last launch left for a step that follows it (its program's)."""
        return self.last.last_packed

    @property
    def last_root(self) -> torch.Tensor:
        return self.last.last_root

    @property
    def masks_ready_first(self) -> bool:
        return self.last.masks_ready_first

    @property
    def num_runs(self) -> int:
        return sum(p.num_runs for p in self._programs())

    @property
    def num_masked_runs(self) -> int:
        return sum(p.num_masked_runs for p in self._programs())

    def _programs(self) -> list:
        return [*self.chains.values(), *self.trees.values()]
