"""Tensor parallelism's two sides of a step: rank 0's runner sends each step before running it (`StepSender`), and
every other rank runs this module: it builds the same engine from the same config (its shard of the model, the
EAGLE-3 head whole) and then runs each step it receives, with the same runner (`serve_steps`).

Every rank runs the whole step, sampling and acceptance included, on the same full logits (the last collective
of the forward leaves every rank the same values) and with the same random state (reseeded once the model is
built), so every rank accepts the same tokens and keeps the same KV, taps, future tokens and program state with
nothing sent back. Only rank 0 reads its results back to the host. A drafting step's drafts are likewise made on
every rank, by the replicated head, with no collective of their own.

Usage (started by rank 0, `distributed/ranks.py`): python -m specserve.engine.tp_worker RANK SIZE INIT PARENT_PID,
with rank 0's EngineConfig and switches (envs.py) pickled on stdin.
"""
from __future__ import annotations

import dataclasses
import hashlib
import logging
import pickle
import sys

import torch

from specserve import envs
from specserve.distributed.ranks import RankGroup, exit_with_parent, join_ranks
from specserve.distributed.steps import AUDIT, STOP, StepChannel, StepDecoder, StepEncoder
from specserve.layers.parallel import whole_embedding

log = logging.getLogger(__name__)


class TargetForDrafting:
    """The target as the replicated EAGLE-3 head reads it under tensor parallelism: its embedding whole on every
    rank (gathered once at startup), so drafting looks tokens up with no collective, level after level; the
    forward and the logits are the sharded model's own (their collectives are the verification's)."""

    def __init__(self, model) -> None:
        self.model = model
        self.embed_tokens = whole_embedding(model.embed_tokens)

    def __call__(self, *args, **kwargs):
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self.model, name)


class StepSender:
    """Rank 0: each step's batch to every other rank, as one broadcast of its encoding (page tables as changes
    against the last step's, `distributed/steps.py`)."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.channel = StepChannel(group.steps)
        self.encoder = StepEncoder()

    def send(self, batch, publish: bool) -> None:
        try:
            self.channel.send(self.encoder.encode(batch, publish))
        except RuntimeError as exc:  # gloo's error for a peer that is gone
            self.group.fail(f"a step could not reach the other ranks ({exc})")

    def resync(self) -> None:
        """After a step that failed: the next one sends every page table whole."""
        self.encoder.resync()

    def replicas_agree(self, runner) -> bool:
        """Whether every rank holds the same replicated state as rank 0 (`fingerprint`): they accepted the same
        tokens. For tests and debugging; it synchronises every device."""
        self.channel.send(self.encoder.encode(None, op=AUDIT))
        prints = gather_fingerprints(runner, self.group.steps, self.group.size)
        return all(p == prints[0] for p in prints)

    def close(self) -> None:
        """Tells the other ranks to stop, waits for them and leaves the process group."""
        if self.group.closing:
            return
        self.group.closing = True
        self.channel.send(self.encoder.encode(None, op=STOP))
        self.group.close()


def fingerprint(runner) -> list[int]:
    """Hashes of what every rank holds whole: the drafter's KV and taps (the head is replicated), the future
    tokens, and what the step program left for a following step. Equal on every rank that sampled and accepted
    what rank 0 did."""
    tensors = [runner.futures.values]
    if runner.proposer is not None:
        drafter = runner.proposer.drafter
        tensors += [getattr(drafter, name) for name in ("kv_cache", "taps") if hasattr(drafter, name)]
    if runner.program is not None:
        tensors += [runner.program.last_packed, runner.program.last_root]
    return [int.from_bytes(hashlib.sha256(t.detach().cpu().contiguous().numpy().tobytes()).digest()[:7], "little")
            for t in tensors]


def gather_fingerprints(runner, group, size: int) -> list[list[int]]:
    mine = torch.tensor(fingerprint(runner), dtype=torch.long)
    prints = [torch.empty_like(mine) for _ in range(size)]
    torch.distributed.all_gather(prints, mine, group=group)
    return [p.tolist() for p in prints]


def serve_steps(runner, channel: StepChannel) -> None:
    """Runs each step rank 0 sends, until it says stop. A step that fails here failed on rank 0 as well (the
    same step on the same state), and rank 0 then sends what it does next (each request alone). Page tables that
    no longer match rank 0's (`StepDesync`) end this process, and with it the engine."""
    decoder = StepDecoder()
    while True:
        message = decoder.decode(channel.receive())
        if message.op == STOP:
            return
        if message.op == AUDIT:
            gather_fingerprints(runner, channel.group, torch.distributed.get_world_size())
            continue
        try:
            runner.launch(message.batch, message.publish)
        except Exception:
            log.exception("step failed")


def main(argv: list[str]) -> int:
    rank, size, init, parent = int(argv[0]), int(argv[1]), argv[2], int(argv[3])
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(message)s")
    config, switches = pickle.load(sys.stdin.buffer)
    exit_with_parent(parent)
    from specserve.engine.factory import build_engine_core, pick_device

    with envs.override(**dataclasses.asdict(switches)):
        group = join_ranks(rank, size, init, pick_device(config))
        core, _ = build_engine_core(config, progress=False, ranks=group)
        with torch.inference_mode():
            serve_steps(core.runner, StepChannel(group.steps))
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
