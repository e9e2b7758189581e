"""Checkpoint formats and configs beyond the greedy-equality tests."""
from __future__ import annotations

import json

import pytest
import torch

from specserve.config import EngineConfig, ModelConfig
from specserve.engine.factory import build_engine_core, resolve_model, shipped_config
from specserve.llm import LLM
from specserve.models.loader import checkpoint_files
from specserve.core import SamplingParams


def test_shipped_llama_31_8b_config_parses():
    cfg = ModelConfig.from_hf_config(json.loads(shipped_config("llama-3.1-8b").read_text()))
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_kv_heads, cfg.vocab_size) == (32, 4096, 8, 128256)
    assert cfg.rope_scaling.rope_type == "llama3" and cfg.rope_scaling.factor == 8.0
    assert cfg.eos_token_ids == (128001, 128008, 128009)


def test_dummy_load_format_builds_random_weights_from_a_config(tiny_checkpoint):
    path = tiny_checkpoint("qwen2")
    llm = LLM(model=str(path), load_format="dummy", max_total_tokens=256)
    assert llm.model_info.weights_dir is None
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4
    from safetensors.torch import load_file

    real = load_file(str(checkpoint_files(path)[0]))["model.embed_tokens.weight"]
    assert not torch.equal(llm.engine.runner.model.embed_tokens.weight, real)


def test_sharded_checkpoints_are_read_through_their_index(tiny_checkpoint):
    path = tiny_checkpoint("llama", True)
    files = checkpoint_files(path)
    assert len(files) > 1 and all(f.suffix == ".safetensors" for f in files)


def test_pickled_weights_load_with_weights_only(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file

    src = tiny_checkpoint("llama-tied")
    state = load_file(str(src / "model.safetensors"))
    torch.save(state, tmp_path / "pytorch_model.bin")
    (tmp_path / "config.json").write_text((src / "config.json").read_text())
    prompt = [[9, 8, 7, 6]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    from_bin = LLM(model=str(tmp_path), max_total_tokens=256).generate(prompt, params)[0].token_ids
    from_safetensors = LLM(model=str(src), max_total_tokens=256).generate(prompt, params)[0].token_ids
    assert from_bin == from_safetensors


def test_no_model_means_the_embedded_smollm2(smollm2_dir):
    # The fixture converted the embedded GGUF into this cache root; resolving the default must reuse it.
    resolved = resolve_model(EngineConfig(cache_dir=str(smollm2_dir.parent)))
    assert resolved.weights_dir == smollm2_dir and resolved.tokenizer_dir == smollm2_dir
    assert resolved.name == "SmolLM2-135M-Instruct"
    assert resolved.model_cfg.num_layers == 30 and resolved.model_cfg.tie_word_embeddings


@pytest.mark.parametrize("kind", ["llama", "llama-tied", "qwen3"])
def test_norm_weights_moved_into_the_projections_keep_greedy_output(tiny_checkpoint, monkeypatch, kind):
    # On a GPU in bf16 (SPECSERVE_NORM_IN_WEIGHTS=1) the loader multiplies each decoder layer's norm weights
    # into the projections after them; the same move here, in fp32, must leave the output HF's.
    from engine_runs import hf_greedy, make_prompts, run_staggered, tight_config

    from specserve.models import loader

    path = tiny_checkpoint(kind)
    monkeypatch.setattr(loader, "norms_go_in_weights", lambda device, dtype: True)
    engine, _ = build_engine_core(tight_config(str(path), 4096), progress=False)
    layer = engine.runner.model.layers[0]
    qkv = layer.self_attn.qkv_proj
    assert layer.mlp.gate_up_proj.norm_in_weight and qkv.norm_in_weight == (qkv.bias is None)
    assert torch.equal(layer.post_attention_layernorm.weight, torch.ones_like(layer.post_attention_layernorm.weight))
    prompts = make_prompts(engine.runner.model.config.vocab_size)
    outputs, _ = run_staggered(engine, prompts)
    assert outputs == hf_greedy(path, prompts)


def test_norm_weights_move_only_for_bf16_on_a_gpu_and_only_when_asked(switches):
    from specserve.layers import linear

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    switches(triton_gemv=True, fold_norms=True, norm_in_weights=False)
    assert not linear.norms_go_in_weights(cuda, torch.bfloat16)
    switches(norm_in_weights=True)
    assert linear.norms_go_in_weights(cuda, torch.bfloat16)
    assert not linear.norms_go_in_weights(cpu, torch.bfloat16)
    assert not linear.norms_go_in_weights(cuda, torch.float32)  # the folds, and so the move, are bf16 only
    switches(fold_norms=False)
    assert not linear.norms_go_in_weights(cuda, torch.bfloat16)
    switches(fold_norms=True, triton_gemv=False)
    assert not linear.norms_go_in_weights(cuda, torch.bfloat16)
