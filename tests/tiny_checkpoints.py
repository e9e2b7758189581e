"""Tiny random checkpoints in Hugging Face's format, and random EAGLE-3 heads for them."""
from __future__ import annotations

import torch

TINY_BASE = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    # A wide init gives peaked logits, so greedy never hinges on a last-bit tie.
    initializer_range=0.3,
    bos_token_id=1,
    eos_token_id=2,
)

# DeepSeek-V3: layer 0 dense (first_k_dense_replace), then MoE layers of eight experts in groups with shared
# experts; MLA with values narrower than the keys; YaRN with both mscales, so the angles and the softmax scale
# are both corrected.
_DEEPSEEK_V3 = dict(
    model_type="deepseek_v3", num_hidden_layers=3, num_key_value_heads=4, tie_word_embeddings=False,
    kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=24, moe_intermediate_size=32,
    n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1, routed_scaling_factor=2.5,
    rope_scaling={"type": "yarn", "factor": 4.0, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                  "mscale_all_dim": 0.7, "original_max_position_embeddings": 128},
)

TINY_CONFIGS = {
    "llama": dict(
        model_type="llama",
        rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
    "llama-tied": dict(model_type="llama", tie_word_embeddings=True, attention_bias=True),
    # One KV head: under tensor parallelism every rank holds a copy of it.
    "llama-mqa": dict(model_type="llama", tie_word_embeddings=True, attention_bias=True, num_key_value_heads=1),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=False, rope_theta=1000000.0),
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=True, head_dim=32),
    "deepseek-v3": dict(_DEEPSEEK_V3, q_lora_rank=None, n_shared_experts=1, n_group=2, topk_group=1),
    "deepseek-v3-qlora": dict(_DEEPSEEK_V3, q_lora_rank=48, n_shared_experts=2, n_group=4, topk_group=2),
    # Layer 1 is dense (mlp_only_layers), the others sparse: eight experts, two per token.
    "qwen3-moe": dict(model_type="qwen3_moe", tie_word_embeddings=False, head_dim=32, num_hidden_layers=4,
                      num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      decoder_sparse_step=1, mlp_only_layers=[1]),
}


def write_tiny_checkpoint(kind: str, path, sharded: bool = False, seed: int = 0) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {**TINY_BASE, **TINY_CONFIGS[kind]}
    model_type = settings.pop("model_type")
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # biases and norms start at zero/one; randomise so the test sees them
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.normal_(1.0 if "norm" in name else 0.0, 0.3)
    model.save_pretrained(path, max_shard_size="200KB" if sharded else "10GB")


def write_peaked_random_head(target_dir, out_dir, scale: float = 15.0, seed: int = 3):
    """A random EAGLE-3 head for `target_dir` whose weights are scaled up, so its logits are far apart and
    its top-k never hinges on rounding."""
    from specserve.models.loader import load_eagle3_head, read_model_config, save_eagle3_head

    head = load_eagle3_head(None, read_model_config(target_dir), torch.float32, torch.device("cpu"), 512, seed=seed)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if not name.endswith("norm.weight"):
                param.mul_(scale)
    save_eagle3_head(head, out_dir)
    return out_dir
