"""Qwen3 (dense): Llama's decoder with an RMSNorm over each head's q and k before rotary."""
from __future__ import annotations

from specserve.config import ModelConfig
from specserve.models.llama import AttentionForm, LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_form(cfg: ModelConfig) -> AttentionForm:
        """`attention_bias` puts biases on q, k, v and o alike, as in Llama."""
        return AttentionForm(qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, qk_norm=True)
