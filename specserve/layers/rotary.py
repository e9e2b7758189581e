"""Rotary position embedding in the Hugging Face "rotate half" layout, with Llama 3.1 frequency scaling."""
from __future__ import annotations

import math

import torch

from specserve.config import RopeScaling
from specserve.kernels import pointwise


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    # fp32 throughout, as the reference does, so angles round the same way at long positions.
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if scaling is None:
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    return _llama3_scaled(inv_freq, scaling)


def _llama3_scaled(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, and the band between blended smoothly.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor
    )
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    middle = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(middle, blended, scaled)


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: RopeScaling | None) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        # cos and sin side by side, one gather per forward; kept in fp32 whatever the model dtype.
        self.register_buffer("cos_sin", torch.cat([angles.cos(), angles.sin()], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return pointwise.rotary(positions, self.cos_sin, q, k)

    def rotate_and_store(self, positions, q, k, v, kv_cache, slot_mapping) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates q and k and writes the rotated k, and v, to their KV cache slots (one kernel on a GPU)."""
        return pointwise.rotary_store(positions, self.cos_sin, q, k, v, kv_cache, slot_mapping)
