"""The engine on a GPU: CUDA graphs and overlapped steps give the eager engine's and transformers' output,
and launching a step makes no host-device synchronisation."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specserve.core import SamplingParams
from specserve.engine.factory import build_engine_core

from engine_runs import engine_greedy, hf_greedy, make_prompts, run_staggered, tight_config

pytestmark = pytest.mark.gpu


def test_decode_steps_replay_cuda_graphs_and_match_eager(tiny_checkpoint):
    path = tiny_checkpoint("llama", True)
    prompts = make_prompts(512, seed=5)
    config = replace(tight_config(str(path), max_total_tokens=200), device="cuda")
    graphed, engine = engine_greedy(config, prompts)
    assert engine.runner.graphs is not None and engine.runner.graphs.num_replays > 20
    eager, engine = engine_greedy(replace(config, disable_cuda_graph=True), prompts)
    assert engine.runner.graphs is None
    assert graphed == eager == hf_greedy(path, prompts, "cuda")


def test_overlapped_steps_never_wait_for_the_device_and_match_transformers(tiny_checkpoint):
    """Greedy fp32 with overlap and graphs equals HF and the engine without overlap; launching a step (its
    scheduling, input copies, replay and sampling) makes no host-device synchronisation: CUDA's sync debug
    mode turns any into an error. The only one left is the read-back of the tokens."""
    path = tiny_checkpoint("llama", True)
    # Seed 9's prompts hit a near-tie where this GPU's fp32 rounding and HF's differ, overlap or not.
    prompts = make_prompts(512, seed=5)
    config = replace(tight_config(str(path), max_total_tokens=200), device="cuda")
    engine, _ = build_engine_core(config, progress=False)
    assert engine.overlap
    launch, checked = engine.runner.launch, []

    def launch_without_syncs(batch, publish=False):
        decode_only = all(len(s.token_ids) == 1 for s in batch.seqs)
        torch.cuda.set_sync_debug_mode("error" if decode_only else "default")
        try:
            output = launch(batch, publish)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        checked.append(decode_only)
        return output

    engine.runner.launch = launch_without_syncs
    overlapped, _ = run_staggered(engine, prompts)
    assert sum(checked) > 20
    synchronous, _ = engine_greedy(replace(config, disable_overlap=True), prompts)
    assert overlapped == synchronous == hf_greedy(path, prompts, "cuda")


def test_graphed_steps_sample_seeded_rows_like_eager_steps(tiny_checkpoint):
    """Graphs take the greedy argmax themselves; a batch with sampled rows samples from the graph's logits
    instead. Seeded sampled rows and greedy rows in the same batches, under overlap: graphed equals eager."""
    path = tiny_checkpoint("llama", True)
    prompts = make_prompts(512, seed=7)
    config = replace(tight_config(str(path), max_total_tokens=200), device="cuda")

    def run(config):
        engine, _ = build_engine_core(config, progress=False)
        for i, prompt in enumerate(prompts):
            params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0 if i % 2 else 0.9,
                                    seed=None if i % 2 else 100 + i)
            engine.add_request(str(i), prompt, params)
        outputs = {str(i): [] for i in range(len(prompts))}
        while engine.has_work():
            for delta in engine.step():
                outputs[delta.request_id] += delta.new_token_ids
        return [outputs[str(i)] for i in range(len(prompts))], engine

    graphed, engine = run(config)
    assert engine.overlap and engine.runner.graphs.num_replays > 5
    eager, engine = run(replace(config, disable_cuda_graph=True))
    assert engine.runner.graphs is None
    assert graphed == eager
    assert all(len(tokens) == 12 for tokens in graphed)
