"""Models on a GPU: tiny models equal transformers in fp32, an 8B-shaped model generates in bf16, and an
EAGLE-3 head's logits fold its norm."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specserve.core import SamplingParams
from specserve.engine.factory import build_engine_core

from engine_runs import check_matches_hf, tight_config

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "qwen3-moe"])
def test_tiny_models_match_transformers_on_gpu_fp32(tiny_checkpoint, kind):
    path = tiny_checkpoint(kind)
    config = replace(tight_config(str(path), max_total_tokens=200), device="cuda")
    check_matches_hf(config, path, vocab=512, device="cuda")


def test_llama_8b_shaped_dummy_generates_in_bf16():
    config = replace(
        tight_config("llama-3.1-8b", max_total_tokens=8192), device="cuda", dtype="bfloat16", load_format="dummy",
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


def test_eagle3_head_logits_fold_its_norm_and_map_drafts_in_bf16(monkeypatch):
    """An EAGLE-3 head's logits in bf16 with its final norm folded into the lm_head GEMV (a chooser that always
    takes a tile, so the fold runs at every row count), against the norm and the product apart in fp32; and the
    chain's argmax with the draft-to-target offsets against `to_target_ids` of torch.argmax."""
    from specserve.config import ModelConfig
    from specserve.kernels import pointwise
    from specserve.kernels.tuning import chooser
    from specserve.sampling.sampler import argmax
    from specserve.models.eagle3 import Eagle3Config, Eagle3Head

    monkeypatch.setattr(chooser, "choice", chooser.Choice(cublas_margin=float("inf"), norm_apart=False))
    cfg = ModelConfig("LlamaForCausalLM", 2000, 512, 1024, 1, 8, 2, 64, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config(cfg, 1000, 512, (0, 0, 0)), 256).cuda().to(torch.bfloat16)
    with torch.inference_mode():
        head.lm_head.weight.normal_(0, 512**-0.5)
        head.norm.weight.uniform_(0.5, 1.5)
        head.d2t.copy_(torch.randint(0, 1000, (1000,)))
        for rows in (1, 4):
            hidden = torch.randn(rows, 512, device="cuda", dtype=torch.bfloat16) * 3
            assert head.lm_head.folds_norm(hidden)
            logits = head.compute_logits(hidden)
            xf = hidden.float()
            normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * head.norm.weight.float()
            torch.testing.assert_close(logits.float(), normed @ head.lm_head.weight.float().T, atol=3e-2, rtol=2e-2)
            unfolded = head.lm_head(pointwise.rms_norm(hidden, head.norm.weight, 1e-5))
            assert torch.equal(argmax(unfolded, head.d2t), head.to_target_ids(unfolded.argmax(dim=-1)))
