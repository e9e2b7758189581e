"""EAGLE-3 draft head, in the public checkpoint layout SGLang and vLLM load (`LlamaForCausalLMEagle3`).

One decoder layer that reads the target's token embedding together with a hidden state: at the first draft
step, the target's low/mid/high layer outputs projected by `fc` ([3H] -> H); after that, the head's own
pre-norm output. Its vocabulary may be a subset of the target's: draft id i is target id i + d2t[i].
Only the math lives here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from specserve.config import ModelConfig
from specserve.kernels import pointwise
from specserve.layers.attention import AttentionMetadata
from specserve.layers.linear import Linear
from specserve.layers.norm import RMSNorm
from specserve.layers.rotary import RotaryEmbedding
from specserve.models.llama import MLP, STACKED_PARAMS, Attention, LlamaForCausalLM


@dataclass(frozen=True)
class Eagle3Config:
    model: ModelConfig  # the head's own layer: hidden size, heads, rope, norm eps
    draft_vocab_size: int
    target_hidden_size: int
    # Which target layer outputs feed `fc`, low to high, numbered as in `eagle_aux_hidden_state_layer_ids`.
    target_layers: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], target_num_layers: int) -> "Eagle3Config":
        if cfg.get("architectures", [None])[0] != "LlamaForCausalLMEagle3":
            raise ValueError("not an EAGLE-3 head: architectures must be ['LlamaForCausalLMEagle3']")
        if cfg.get("num_hidden_layers", 1) != 1:
            raise ValueError("an EAGLE-3 head has exactly one layer")
        model = ModelConfig.from_hf_config({**cfg, "architectures": ["LlamaForCausalLM"]})
        taps = (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return cls(
            model=model,
            draft_vocab_size=cfg.get("draft_vocab_size") or model.vocab_size,
            target_hidden_size=cfg.get("target_hidden_size") or model.hidden_size,
            target_layers=tuple(taps) if taps else default_target_layers(target_num_layers),
        )

    def to_hf_config(self) -> dict[str, Any]:
        m = self.model
        return {
            "architectures": ["LlamaForCausalLMEagle3"],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "hidden_size": m.hidden_size,
            "intermediate_size": m.intermediate_size,
            "num_attention_heads": m.num_heads,
            "num_key_value_heads": m.num_kv_heads,
            "head_dim": m.head_dim,
            "rms_norm_eps": m.rms_norm_eps,
            "rope_theta": m.rope_theta,
            "max_position_embeddings": m.max_position_embeddings,
            "vocab_size": m.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "tie_word_embeddings": False,
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.target_layers)},
        }


def default_target_layers(num_layers: int) -> tuple[int, ...]:
    """The residual streams entering layers 2, L/2 and L-3, which are the outputs of the layers before them.
    SGLang and SpecForge use the same default, so a head trained without `eagle_config` lines up."""
    taps = (1, num_layers // 2 - 1, num_layers - 4)
    return tuple(min(max(t, 0), num_layers - 1) for t in taps)  # tiny test models have too few layers


class Eagle3MidLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, LlamaForCausalLM.attention_form(cfg), in_features=2 * cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds, hidden, positions, rotary, kv_cache, meta, token_ids=None, rows=None) -> torch.Tensor:
        # Both norms are built with the config's eps; on a GPU one kernel norms both into the layer's input (and
        # looks the tokens up in the embedding, given their ids).
        x = pointwise.rms_norm_pair(embeds, self.input_layernorm.weight, hidden, self.hidden_norm.weight,
                                    self.input_layernorm.eps, token_ids)
        # Past attention each row is on its own, so rows nobody reads stop there.
        residual = hidden if rows is None else hidden[rows]
        hidden = self.self_attn(x, positions, rotary, kv_cache, meta, add=residual, rows=rows)
        return self.mlp(hidden, self.post_attention_layernorm, add=hidden)


class Eagle3Head(nn.Module):
    stacked_params = STACKED_PARAMS

    def __init__(self, cfg: Eagle3Config, max_positions: int) -> None:
        super().__init__()
        m = cfg.model
        self.config = cfg
        self.fc = Linear(len(cfg.target_layers) * cfg.target_hidden_size, m.hidden_size, bias=False)
        self.midlayer = Eagle3MidLayer(m)
        self.norm = RMSNorm(m.hidden_size, m.rms_norm_eps)
        self.lm_head = Linear(m.hidden_size, cfg.draft_vocab_size, bias=False)
        self.lm_head.takes_norm = True  # compute_logits folds the final norm into it where the GEMV runs
        self.rotary = RotaryEmbedding(m.head_dim, max_positions, m.rope_theta, m.rope_scaling)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.ones(m.vocab_size, dtype=torch.bool))

    def project_taps(self, taps: list[torch.Tensor]) -> torch.Tensor:
        """[T, H] from the target's tapped layer outputs, low to high."""
        return self.fc(torch.cat(taps, dim=-1))

    def forward(
        self,
        embeds: torch.Tensor,  # [T, H] target embeddings of the input tokens
        hidden: torch.Tensor,  # [T, H] projected target taps, or the head's own previous output
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,  # [1, 2, num_slots, Hkv, D]
        token_ids: torch.Tensor | None = None,  # [T]: then `embeds` is the target's embedding table [V, H]
        rows: torch.Tensor | None = None,  # [R]: only these rows' outputs are wanted (all T rows' KV is stored)
    ) -> torch.Tensor:
        """Returns the pre-norm hidden state ([T, H], or [R, H] with `rows`): feed it back for the next draft
        step, or to `compute_logits`."""
        return self.midlayer(embeds, hidden, positions, self.rotary, kv_cache[0], meta, token_ids, rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits (the norm folded into the lm_head's GEMV where that runs: one kernel fewer a
        draft step)."""
        return self.lm_head(hidden, norm=self.norm)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]


def vocab_maps(target_ids: torch.Tensor, target_vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for a draft vocabulary made of `target_ids` (sorted ascending)."""
    d2t = target_ids - torch.arange(len(target_ids))
    t2d = torch.zeros(target_vocab, dtype=torch.bool)
    t2d[target_ids] = True
    return d2t, t2d

