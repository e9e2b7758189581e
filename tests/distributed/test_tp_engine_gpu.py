"""The tensor-parallel engine on two GPUs (NCCL, NVLink multicast off): decode steps replay CUDA graphs with the
all-reduces captured inside, the chain and tree programs too, overlapped; the output equals one GPU's and HF's,
and every rank accepts what rank 0 accepts. Skipped without two GPUs."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specserve.config import ParallelConfig, SpecConfig
from specserve.engine.factory import build_engine_core

from engine_runs import engine_greedy, hf_greedy, make_prompts, run_staggered, tight_config
from tiny_checkpoints import write_peaked_random_head

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]


def _two_gpus(config):
    engine, _ = build_engine_core(replace(config, device="cuda", parallel=ParallelConfig(2)), progress=False)
    return engine


@pytest.mark.parametrize("kind", ["llama", "qwen3-moe", "deepseek-v3"])
def test_captured_decode_on_two_gpus_matches_one_gpu(tiny_checkpoint, kind):
    path = tiny_checkpoint(kind, True)
    prompts = make_prompts(512, seed=5)
    config = tight_config(str(path), max_total_tokens=200)
    one, _ = engine_greedy(replace(config, device="cuda"), prompts)
    engine = _two_gpus(config)
    try:
        assert engine.overlap and engine.runner.graphs is not None
        two, _ = run_staggered(engine, prompts)
        replays = engine.runner.graphs.num_replays
    finally:
        engine.runner.step_sender.close()
    assert replays > 20
    assert two == one == hf_greedy(path, prompts, "cuda")


@pytest.mark.parametrize("spec", [dict(num_steps=3), dict(num_steps=4, eagle_topk=3, num_draft_tokens=9)],
                         ids=["chain", "tree"])
def test_captured_programs_on_two_gpus_are_lossless(tmp_path, tiny_checkpoint, spec):
    path = tiny_checkpoint("llama", True)
    write_peaked_random_head(path, tmp_path)
    prompts = make_prompts(512, seed=4)
    engine = _two_gpus(replace(tight_config(str(path), 200), spec=SpecConfig("EAGLE3", str(tmp_path), **spec)))
    try:
        assert engine.runner.program is not None and engine.runner.program.last.graphs
        outputs, _ = run_staggered(engine, prompts)
        agree = engine.runner.step_sender.replicas_agree(engine.runner)
        runs = engine.runner.program.num_runs
    finally:
        engine.runner.step_sender.close()
    assert runs > 10 and agree
    assert outputs == hf_greedy(path, prompts, "cuda")
