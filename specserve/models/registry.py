"""The one list of supported architectures: the name in a HF config's `architectures` -> its model class.

A new architecture is its model file (implementing models/base.py's `CausalLM`) and one line here.
"""
from __future__ import annotations

from typing import Any

from specserve.config import ModelConfig
from specserve.models.base import CausalLM
from specserve.models.deepseek_v3 import DeepseekV3ForCausalLM
from specserve.models.llama import LlamaForCausalLM
from specserve.models.qwen2 import Qwen2ForCausalLM
from specserve.models.qwen3 import Qwen3ForCausalLM
from specserve.models.qwen3_moe import Qwen3MoeForCausalLM

_MODELS: dict[str, type[CausalLM]] = {
    "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM,
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(_MODELS))


def model_class(architecture: str) -> type[CausalLM]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; "
                         f"supported: {supported_architectures()}") from None


def model_config(hf_config: dict[str, Any]) -> ModelConfig:
    """The ModelConfig of a parsed HF config.json, refused (ValueError) unless its architecture is one of ours:
    call it where a model is resolved, so a bad config fails before any weights are read."""
    cfg = ModelConfig.from_hf_config(hf_config)
    model_class(cfg.architecture)
    return cfg
