"""The interface between the runner and speculation.

A step's batch says per sequence how many tokens to draft (`ScheduledSeq.num_draft_tokens`, decided by the
scheduler and the draft plan). Speculation answers through two objects, which a `--speculative-algorithm`'s
registry entry (speculative/registry.py) builds once at startup:

- a `Proposer`, the general path: `propose(batch)` drafts one tree per drafting sequence; the runner computes
  every node with the target in one forward and accepts with `verify` (speculative/verify.py), a pure function.
  It serves any batch (prompt chunks riding along, seeded sampling, a draft model), at the price of host work
  and read-backs between draft levels;
- optionally a `StepProgram`: the whole step (catch up, draft, verify, accept) as one device program, captured
  in CUDA graphs, for the batches it `fits`. The runner asks it first.

The runner never looks inside either: it asks `fits`, then `launch`es the program, or runs the general path
with the proposer. Neither calls back into the runner.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Protocol

import torch

from specserve.config import EngineConfig, ModelConfig
from specserve.core import StepBatch
from specserve.speculative.tree import DraftTree


class Proposer(Protocol):
    # Target layers whose outputs the proposer reads; the runner hands them over through `observe`.
    capture_layers: tuple[int, ...]
    # Where grammar masks for draft rows are built beside the drafter's forwards (structured/step_masks.py
    # MaskWorker); None: in the search's own thread.
    mask_worker: object | None

    def propose(self, batch: StepBatch) -> dict[int, DraftTree]:
        """{sequence index: a tree rooted at its last token with exactly `num_draft_tokens` drafts} for every
        sequence that drafts. Drafts are chosen deterministically, which keeps `verify` lossless."""

    def extend_drafter(self, batch: StepBatch) -> None:
        """After the target's forward: extend the drafter over catch-up tokens of sequences that do not draft."""

    def observe(self, captured: list[torch.Tensor], slot_mapping: torch.Tensor) -> None:
        """The target's tapped layer outputs for the tokens it computed this step, at their KV slots."""

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """The runner moved accepted tree nodes' KV from `src` to `dst` slots; move what is kept per slot."""


class StepProgram(Protocol):
    """A speculative step as one device program (speculative/programs/)."""

    # Tokens a row may emit: its packed output is [rows, width + 1] (the tokens, then the accepted draft count).
    width: int

    def fits(self, batch: StepBatch) -> bool:
        """Whether the program can run this batch (shapes, sampling settings, how far the drafter is behind).
        A batch whose `follow` is set (an overlapped step continuing the last launch) only a program can run."""

    def launch(self, batch: StepBatch, timer) -> torch.Tensor:
        """Queues the step on the device; returns its packed rows (`unpack` reads them), without a sync."""

    @property
    def masks_ready_first(self) -> bool:
        """Whether the last launch, if it held rows under a grammar, had its verify rows' masks built before
        the device finished the verify forward."""


@dataclass(frozen=True)
class Speculator:
    """What one speculative algorithm gives the engine."""

    proposer: Proposer
    program: StepProgram | None = None


class Algorithm(Protocol):
    """One `--speculative-algorithm` (speculative/registry.py), built in the factory's order: the draft network is
    loaded first, then the KV pool is sized with what the algorithm keeps, then the speculator is built on it."""

    def load(self, config: EngineConfig, target_cfg: ModelConfig, dtype: torch.dtype, device: torch.device,
             max_model_len: int, progress: bool) -> torch.nn.Module:
        """The draft network, checked against the target."""

    def bytes_per_token(self, network: torch.nn.Module, dtype: torch.dtype) -> int:
        """What the drafter keeps per target KV slot (its own KV, taps), for sizing the pool."""

    def target_scratch_slots(self, config: EngineConfig, device: torch.device, max_bs: int) -> int:
        """Slots the algorithm needs in the target's pool after its pages (a tree program's verify nodes)."""

    def needs_pad_page(self, config: EngineConfig, device: torch.device) -> bool:
        """Whether it needs a page no request owns, for padded rows' KV (step programs do)."""

    def build(self, config: EngineConfig, network: torch.nn.Module, target: torch.nn.Module, kv_cache: torch.Tensor,
              num_slots: int, max_bs: int, max_model_len: int, rng: random.Random, capture: bool,
              progress: bool) -> Speculator:
        """The speculator on the allocated pool: `num_slots` page slots, then the padding page and scratch."""
