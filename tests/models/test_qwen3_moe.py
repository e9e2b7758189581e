"""Qwen3-MoE: the shipped 30B-A3B config builds the real model's shape; a tiny random checkpoint that mixes
dense and sparse layers loads its per-expert tensors into the stacked experts and generates what transformers
generates, token for token, under chunked prefill, preemption and mixed batches; and speculative greedy output
(EAGLE-3 head, draft model; chain and tree) equals plain greedy output."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from specserve.config import ModelConfig, SpecConfig
from specserve.engine.factory import build_engine_core, shipped_config
from specserve.models.loader import build_model, read_model_config

from engine_runs import check_matches_hf, count_accepted, hf_greedy, make_prompts, run_staggered, tight_config
from tiny_checkpoints import write_peaked_random_head


def test_shipped_qwen3_30b_a3b_config_builds_the_real_shape():
    from specserve.models.qwen3_moe import Qwen3MoeForCausalLM

    cfg = ModelConfig.from_hf_config(json.loads(shipped_config("qwen3-30b-a3b").read_text()))
    moe = cfg.moe
    assert (moe.num_experts, moe.top_k, moe.intermediate_size, moe.norm_topk_prob) == (128, 8, 768, True)
    assert moe.sparse_layers == tuple(range(48))
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg, max_positions=16)
    total = sum(p.numel() for p in model.parameters())
    expert = 3 * cfg.hidden_size * moe.intermediate_size
    active = total - cfg.num_layers * (moe.num_experts - moe.top_k) * expert
    # The model card: 30.5B parameters in total, 3.3B activated.
    assert round(total / 1e9, 1) == 30.5 and 3.3e9 <= active < 3.4e9


@pytest.mark.parametrize("step,mlp_only", [(1, []), (1, [0, 2]), (2, []), (2, [3]), (3, [1])])
def test_sparse_layers_are_those_transformers_builds(step, mlp_only):
    from transformers import AutoConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeDecoderLayer, Qwen3MoeSparseMoeBlock

    hf = AutoConfig.for_model("qwen3_moe", hidden_size=16, intermediate_size=16, moe_intermediate_size=8,
                              num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1, num_experts=4,
                              num_experts_per_tok=2, decoder_sparse_step=step, mlp_only_layers=mlp_only)
    sparse = tuple(i for i in range(6) if isinstance(Qwen3MoeDecoderLayer(hf, i).mlp, Qwen3MoeSparseMoeBlock))
    ours = ModelConfig.from_hf_config({**hf.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]})
    assert ours.moe.sparse_layers == sparse


def test_experts_load_stacked_gate_then_up(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("qwen3-moe", True)
    ours = build_model(read_model_config(path), path, torch.float32, torch.device("cpu"), 64, progress=False)
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).state_dict()
    assert [type(layer.mlp).__name__ for layer in ours.layers] == ["SparseMoeBlock", "MLP", "SparseMoeBlock",
                                                                    "SparseMoeBlock"]
    for i in (0, 2, 3):  # transformers keeps its experts stacked in the same layout
        assert torch.equal(ours.layers[i].mlp.experts.w13, theirs[f"model.layers.{i}.mlp.experts.gate_up_proj"])
        assert torch.equal(ours.layers[i].mlp.experts.w2, theirs[f"model.layers.{i}.mlp.experts.down_proj"])
        assert torch.equal(ours.layers[i].mlp.gate.weight, theirs[f"model.layers.{i}.mlp.gate.weight"])


def test_a_missing_expert_tensor_is_refused(tiny_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    path = tiny_checkpoint("qwen3-moe")
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError, match="missing 1 tensors"):
        build_model(read_model_config(tmp_path), tmp_path, torch.float32, torch.device("cpu"), 64, progress=False)


def test_greedy_matches_transformers(tiny_checkpoint):
    path = tiny_checkpoint("qwen3-moe", True)
    check_matches_hf(tight_config(str(path), max_total_tokens=200), path, vocab=512)


def test_dummy_load_format_generates(tiny_checkpoint):
    from specserve.core import SamplingParams
    from specserve.llm import LLM

    llm = LLM(model=str(tiny_checkpoint("qwen3-moe")), load_format="dummy", max_total_tokens=256)
    assert llm.model_info.weights_dir is None
    out = llm.generate([[5, 6, 7], [9] * 20], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [4, 4]


@pytest.fixture(scope="module")
def moe_reference(tiny_checkpoint):
    path = tiny_checkpoint("qwen3-moe", True)
    prompts = make_prompts(512)
    return path, prompts, hf_greedy(path, prompts)


@pytest.fixture(scope="module")
def moe_eagle3_head(tiny_checkpoint, tmp_path_factory):
    return write_peaked_random_head(tiny_checkpoint("qwen3-moe", True), tmp_path_factory.mktemp("moe-eagle3"))


# An EAGLE-3 head drafting a chain of 3 (its step program) and a tree of top-4 over 3 levels verifying 16 tokens
# (the general search, and the tree program); a draft model (the target itself, MoE too) drafting the tree.
@pytest.mark.parametrize("algorithm,topk,num_steps,num_draft_tokens,tree_program",
                         [("EAGLE3", 1, 3, None, False), ("EAGLE3", 4, 3, 16, False), ("EAGLE3", 4, 3, 16, True),
                          ("DRAFT_MODEL", 4, 3, 16, False)])
def test_speculative_greedy_equals_plain_greedy(moe_reference, moe_eagle3_head, switches, algorithm, topk, num_steps,
                                                num_draft_tokens, tree_program):
    switches(tree_program_on_cpu=tree_program)
    path, prompts, reference = moe_reference
    draft = moe_eagle3_head if algorithm == "EAGLE3" else path  # the draft model: the target itself
    spec = SpecConfig(algorithm, str(draft), num_steps, topk, num_draft_tokens)
    engine, _ = build_engine_core(replace(tight_config(str(path), 136), spec=spec), progress=False)
    assert (engine.runner.program is not None) == (topk == 1 or tree_program)
    accepted = count_accepted(engine)
    ours, _ = run_staggered(engine, prompts)
    assert ours == reference
    assert accepted and engine.scheduler.num_preemptions > 0
    if algorithm == "DRAFT_MODEL":  # a copy of the target drafts the target's own greedy tokens
        assert sum(accepted) > 1.5 * len(accepted)
    alloc = engine.scheduler.allocator
    assert alloc.num_free == alloc.num_pages
    alloc.check_invariants()


def test_a_bf16_model_is_built_in_bf16(tiny_checkpoint, monkeypatch):
    """No fp32 copy first: a 30B model's would not fit beside its bf16 one, and its freed blocks would stay in the
    CUDA cache. Weights and rotary angles come out as a cast of the fp32 model would give them."""
    import specserve.models.loader as loader
    from specserve.models.qwen3_moe import Qwen3MoeForCausalLM

    built_in = []

    class Spy(Qwen3MoeForCausalLM):
        def __init__(self, cfg, max_positions, **kwargs):
            built_in.append(torch.get_default_dtype())
            super().__init__(cfg, max_positions, **kwargs)

    path = tiny_checkpoint("qwen3-moe", True)
    cfg = read_model_config(path)
    reference = build_model(cfg, path, torch.float32, torch.device("cpu"), 64, progress=False)
    monkeypatch.setattr(loader, "model_class", lambda architecture: Spy)
    model = build_model(cfg, path, torch.bfloat16, torch.device("cpu"), 64, progress=False)
    assert built_in == [torch.bfloat16] and torch.get_default_dtype() == torch.float32
    for (name, ours), theirs in zip(model.state_dict().items(), reference.state_dict().values()):
        expected = theirs.to(torch.bfloat16).to(ours.dtype) if theirs.is_floating_point() else theirs
        assert torch.equal(ours, expected), name
