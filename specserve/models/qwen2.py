"""Qwen2 and Qwen2.5: Llama's decoder with biases on q, k and v."""
from __future__ import annotations

from specserve.config import ModelConfig
from specserve.models.llama import AttentionForm, LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_form(cfg: ModelConfig) -> AttentionForm:
        """q, k and v always carry biases and o never does, whatever `attention_bias` says (a GGUF conversion
        sets it from the q bias)."""
        return AttentionForm(qkv_bias=True)
