"""The one list of architectures (models/registry.py) and the model contract (models/base.py)."""
from __future__ import annotations

import json

import pytest
import torch

from specserve.config import EngineConfig, ModelConfig
from specserve.models import gguf
from specserve.models.base import CausalLM
from specserve.models.loader import build_model, read_model_config
from specserve.models.registry import model_class, model_config, supported_architectures

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)


# What an architecture needs beyond a Llama's fields.
TINY_EXTRA = {
    "DeepseekV3ForCausalLM": dict(q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8,
                                  v_head_dim=8),
}


def _build(architecture: str, **hf) -> torch.nn.Module:
    cfg = model_config({**TINY, **TINY_EXTRA.get(architecture, {}), "architectures": [architecture], **hf})
    return build_model(cfg, None, torch.float32, torch.device("cpu"), 32, progress=False)


@pytest.mark.parametrize("architecture", supported_architectures())
def test_every_registered_architecture_builds_a_causal_lm(architecture):
    model = _build(architecture)
    assert isinstance(model, CausalLM) and model.config.architecture == architecture


def test_an_unsupported_architecture_names_itself_and_the_supported_ones():
    with pytest.raises(ValueError, match=r"'GPT2LMHeadModel'.*LlamaForCausalLM.*Qwen3ForCausalLM"):
        model_class("GPT2LMHeadModel")
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        model_config({**TINY, "architectures": ["GPT2LMHeadModel"]})


def test_an_unsupported_architecture_fails_before_weights_are_read(tmp_path):
    from specserve.engine.factory import build_engine_core

    # No weights in the directory: were they read first, this would fail on the missing files instead.
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        read_model_config(tmp_path)
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        build_engine_core(EngineConfig(model_path=str(tmp_path), device="cpu"), progress=False)


def test_the_config_parses_any_architecture_and_leaves_the_check_to_the_registry():
    cfg = ModelConfig.from_hf_config({**TINY, "architectures": ["GPT2LMHeadModel"], "attention_bias": True})
    assert cfg.architecture == "GPT2LMHeadModel" and cfg.attention_bias


@pytest.mark.parametrize("architecture,attention_bias,qkv_bias,o_bias,qk_norm", [
    ("LlamaForCausalLM", False, False, False, False),
    ("LlamaForCausalLM", True, True, True, False),
    ("Qwen2ForCausalLM", False, True, False, False),
    ("Qwen2ForCausalLM", True, True, False, False),  # as a GGUF conversion writes it: o_proj still has none
    ("Qwen3ForCausalLM", False, False, False, True),
    ("Qwen3ForCausalLM", True, True, True, True),
])
def test_each_architecture_reads_attention_bias_its_own_way(architecture, attention_bias, qkv_bias, o_bias,
                                                            qk_norm):
    attn = _build(architecture, attention_bias=attention_bias).layers[0].self_attn
    assert (attn.qkv_proj.bias is not None, attn.o_proj.bias is not None) == (qkv_bias, o_bias)
    assert (attn.q_norm is not None) == (attn.k_norm is not None) == qk_norm


def test_every_architecture_a_gguf_file_converts_to_is_registered():
    assert set(gguf._ARCH_CLASSES.values()) <= set(supported_architectures())
