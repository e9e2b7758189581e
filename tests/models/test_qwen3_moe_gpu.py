"""Qwen3-MoE on a GPU: the 30B-A3B dummy in bf16 fits one H200 beside a KV pool for 250 requests of 512 + 256
tokens, and generates through the fused MoE kernel, CUDA graphs included."""
from __future__ import annotations

import pytest
import torch

from specserve.config import EngineConfig
from specserve.core import SamplingParams
from specserve.engine.factory import build_engine_core

pytestmark = pytest.mark.gpu


def test_qwen3_30b_a3b_dummy_fits_with_a_250_request_pool_and_generates():
    if torch.cuda.get_device_properties(0).total_memory < 120 * 2**30:
        pytest.skip("61 GB of bf16 weights and an 18 GB pool: an H200-sized GPU")
    config = EngineConfig(model_path="qwen3-30b-a3b", load_format="dummy", dtype="bfloat16", device="cuda",
                          context_length=4096)
    engine, _ = build_engine_core(config, progress=False)
    assert engine.runner.model.layers[0].mlp.experts.w13.dtype == torch.bfloat16
    alloc = engine.scheduler.allocator
    assert alloc.num_pages * config.cache.page_size >= 250 * (512 + 256)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i, n in enumerate((5, 300, 1000, 17)):
        engine.add_request(str(i), list(range(1000, 1000 + n)), params)
    produced = {}
    while engine.has_work():
        for delta in engine.step():
            produced.setdefault(delta.request_id, []).extend(delta.new_token_ids)
    assert all(len(v) == 8 and all(0 <= t < 151936 for t in v) for v in produced.values())
    assert alloc.num_free == alloc.num_pages
