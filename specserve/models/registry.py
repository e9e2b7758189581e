"""Architecture name (as in a HF config's `architectures`) -> model class."""
from __future__ import annotations

from torch import nn

from specserve.models.llama import LlamaForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


def model_class(architecture: str) -> type[nn.Module]:
    try:
        return _MODELS[architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(_MODELS)}") from None
