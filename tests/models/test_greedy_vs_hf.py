"""Greedy output equals Hugging Face transformers token for token (fp32, CPU), under continuous batching
with mixed prompt lengths, staggered arrivals, chunked prefill and forced preemption."""
from __future__ import annotations

import random

import pytest
import torch

from specserve.config import CacheConfig, EngineConfig, SchedulerConfig
from specserve.engine.factory import build_engine_core
from specserve.core import SamplingParams

PROMPT_LENS = [3, 17, 40, 9, 64, 25, 1, 33]
ARRIVAL_STEPS = [0, 0, 1, 3, 3, 6, 10, 11]
MAX_TOKENS = 24


def _prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in PROMPT_LENS]


def _hf_greedy(model_dir, prompts: list[list[int]], device: str = "cpu", max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
    outs = []
    for prompt in prompts:
        ids = model.generate(torch.tensor([prompt], device=device), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device))
        outs.append(ids[0, len(prompt):].tolist())
    return outs


def _engine_greedy(config: EngineConfig, prompts: list[list[int]]):
    engine, _ = build_engine_core(config, progress=False)
    outputs, _ = run_staggered(engine, prompts)
    return outputs, engine


def run_staggered(engine, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> tuple[list[list[int]], int]:
    """Feeds prompt i at step ARRIVAL_STEPS[i]; returns the greedy outputs and the number of engine steps."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    step = 0
    while step <= max(ARRIVAL_STEPS) or engine.has_work():
        for i, arrival in enumerate(ARRIVAL_STEPS):
            if arrival == step:
                engine.add_request(str(i), prompts[i], params)
        for delta in engine.step():
            outputs[delta.request_id] += delta.new_token_ids
        step += 1
    return [outputs[str(i)] for i in range(len(prompts))], step


def _tight_config(model_path: str | None, max_total_tokens: int) -> EngineConfig:
    return EngineConfig(
        model_path=model_path,
        dtype="float32",
        device="cpu",
        cache=CacheConfig(page_size=8, max_total_tokens=max_total_tokens),
        scheduler=SchedulerConfig(max_running_requests=6, chunked_prefill_size=32),
    )


def _check(config: EngineConfig, model_dir, vocab: int, device: str = "cpu") -> None:
    prompts = _prompts(vocab)
    ours, engine = _engine_greedy(config, prompts)
    theirs = _hf_greedy(model_dir, prompts, device)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        assert a == b, f"prompt {i} (len {PROMPT_LENS[i]}) diverged at token {next(j for j, (x, y) in enumerate(zip(a, b)) if x != y)}"
    assert engine.scheduler.num_preemptions > 0, "the pool is meant to be small enough to force preemption"
    alloc = engine.scheduler.allocator
    assert alloc.num_free == alloc.num_pages
    alloc.check_invariants()


@pytest.mark.parametrize("kind,sharded", [("llama", True), ("llama-tied", False), ("qwen2", False), ("qwen3", False)])
def test_tiny_models_match_transformers(tiny_checkpoint, kind, sharded):
    path = tiny_checkpoint(kind, sharded)
    _check(_tight_config(str(path), max_total_tokens=200), path, vocab=512)


def test_smollm2_135m_matches_transformers(smollm2_dir):
    _check(_tight_config(str(smollm2_dir), max_total_tokens=200), smollm2_dir, vocab=49152)
