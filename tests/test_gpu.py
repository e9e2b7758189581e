"""The same correctness checks on a GPU. Skipped on machines without CUDA (CI has none)."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specserve.engine.factory import build_engine_core
from specserve.sampling_params import SamplingParams

from test_greedy_vs_hf import _check, _tight_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_tiny_models_match_transformers_on_gpu_fp32(tiny_checkpoint, kind):
    path = tiny_checkpoint(kind)
    config = replace(_tight_config(str(path), max_total_tokens=200), device="cuda")
    _check(config, path, vocab=512, device="cuda")


def test_llama_8b_shaped_dummy_generates_in_bf16():
    config = replace(
        _tight_config("llama-3.1-8b", max_total_tokens=8192), device="cuda", dtype="bfloat16", load_format="dummy",
        context_length=4096,
    )
    engine, _ = build_engine_core(config, progress=False)
    assert engine.runner.model.embed_tokens.weight.dtype == torch.bfloat16
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((5, 300, 1000, 17)):
        engine.add_request(str(i), list(range(1000, 1000 + n)), params)
    produced = {}
    while engine.has_work():
        for delta in engine.step():
            produced.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    assert all(len(v) == 8 and all(0 <= t < 128256 for t in v) for v in produced.values())
    alloc = engine.scheduler.allocator
    assert alloc.num_free == alloc.num_pages
