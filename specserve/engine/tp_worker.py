"""Tensor parallelism's two sides of a step: rank 0's runner sends each step before running it (`StepSender`), and
every other rank runs this module: it builds the same engine from the same config (its shard of the model, the
EAGLE-3 head whole) and then runs each step it receives, with the same runner (`serve_steps`).

Every rank runs the whole step, sampling and acceptance included, on the same full logits (the last collective
of the forward leaves every rank the same values) and with the same random state (reseeded once the model is
built), so every rank accepts the same tokens and keeps the same KV, taps, future tokens and program state with
nothing sent back. Only rank 0 reads its results back to the host. A drafting step's drafts are likewise made on
every rank, by the replicated head, with no collective of their own.

Usage (started by rank 0, `distributed/ranks.py`): python -m specserve.engine.tp_worker RANK SIZE INIT PARENT_PID,
with the EngineConfig pickled on stdin.
"""
from __future__ import annotations

import logging
import pickle
import sys

import torch

from specserve.distributed.ranks import RankGroup, exit_with_parent, join_ranks
from specserve.distributed.steps import STOP, StepChannel, decode, encode

log = logging.getLogger(__name__)


class StepSender:
    """Rank 0: each step's batch to every other rank, as one broadcast of its encoding."""

    def __init__(self, group: RankGroup) -> None:
        self.group = group
        self.channel = StepChannel(group.steps)

    def send(self, batch, publish: bool) -> None:
        self.channel.send(encode(batch, publish))

    def close(self) -> None:
        """Tells the other ranks to stop, waits for them and leaves the process group."""
        if self.group.closing:
            return
        self.group.closing = True
        self.channel.send(encode(None, op=STOP))
        self.group.close()


def serve_steps(runner, channel: StepChannel) -> None:
    """Runs each step rank 0 sends, until it says stop. A step that fails here failed on rank 0 as well (the
    same step on the same state), and rank 0 then sends what it does next (each request alone)."""
    while True:
        message = decode(channel.receive())
        if message.op == STOP:
            return
        try:
            runner.launch(message.batch, message.publish)
        except Exception:
            log.exception("step failed")


def main(argv: list[str]) -> int:
    rank, size, init, parent = int(argv[0]), int(argv[1]), argv[2], int(argv[3])
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank-{rank} %(levelname)s %(message)s")
    config = pickle.load(sys.stdin.buffer)
    exit_with_parent(parent)
    from specserve.engine.factory import build_engine_core, pick_device

    group = join_ranks(rank, size, init, pick_device(config))
    core, _ = build_engine_core(config, progress=False, ranks=group)
    with torch.inference_mode():
        serve_steps(core.runner, StepChannel(group.steps))
    torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
