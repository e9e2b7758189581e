"""Tensor parallelism on the CPU: two gloo ranks, the test process as rank 0. Greedy output with --tp-size 2
equals HF's (which --tp-size 1 is held to in tests/models), and speculation stays lossless."""
from __future__ import annotations

from dataclasses import replace

import pytest

from specserve.config import ParallelConfig, SpecConfig
from specserve.distributed.ranks import NO_MULTICAST_ENV
from specserve.engine.factory import build_engine_core

from engine_runs import hf_greedy, make_prompts, run_staggered, tight_config
from tiny_checkpoints import write_peaked_random_head


def tp_engine(config, size: int = 2):
    engine, _ = build_engine_core(replace(config, parallel=ParallelConfig(size)), progress=False)
    return engine


def closed(engine):
    """Stops the other ranks and leaves the process group, so the next test can form its own."""
    engine.runner.step_sender.close()


def _all_pages_back(engine) -> bool:
    alloc = engine.scheduler.allocator
    alloc.check_invariants()
    return alloc.num_free == alloc.num_pages


@pytest.mark.parametrize("kind", ["llama", "qwen3-moe", "deepseek-v3"])
def test_greedy_with_two_ranks_matches_transformers(kind, tiny_checkpoint):
    path = tiny_checkpoint(kind, True)
    prompts = make_prompts(512)
    engine = tp_engine(tight_config(str(path), max_total_tokens=160))
    try:
        ours, _ = run_staggered(engine, prompts)
    finally:
        closed(engine)
    assert ours == hf_greedy(path, prompts)
    assert engine.scheduler.num_preemptions > 0 and _all_pages_back(engine)


def test_every_rank_runs_with_nvlink_multicast_off(tiny_checkpoint):
    engine = tp_engine(tight_config(str(tiny_checkpoint("llama", True)), max_total_tokens=160))
    try:
        worker = engine.runner.step_sender.group.workers[0]
        with open(f"/proc/{worker.pid}/environ", "rb") as f:
            env = dict(item.split(b"=", 1) for item in f.read().split(b"\0") if b"=" in item)
    finally:
        closed(engine)
    assert {k: env.get(k.encode()) for k in NO_MULTICAST_ENV} == {k: v.encode() for k, v in NO_MULTICAST_ENV.items()}
    assert worker.returncode == 0
