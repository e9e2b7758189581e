"""Rotary position embedding in the Hugging Face "rotate half" layout, with Llama 3.1 and YaRN frequency scaling."""
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
    if scaling.rope_type == "yarn":
        return _yarn_scaled(head_dim, theta, scaling)
    return _llama3_scaled(inv_freq, scaling)


def _yarn_scaled(head_dim: int, theta: float, s: RopeScaling) -> torch.Tensor:
    # Dimensions that turn fewer than beta_slow times over the original context are interpolated by `factor`,
    # those that turn more than beta_fast times kept, and a linear ramp blends the band between.
    def turns_to_dim(turns: float) -> float:
        return head_dim * math.log(s.original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = turns_to_dim(s.beta_fast), turns_to_dim(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a band of width zero would divide by zero
    kept = 1 - ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    wavelengths = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    # Rounded in transformers' order, so angles agree to the last bit.
    return 1.0 / (s.factor * wavelengths) * (1 - kept) + 1.0 / wavelengths * kept


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context `factor` times the original."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def angle_scale(scaling: RopeScaling | None) -> float:
    """What YaRN multiplies cos and sin by (1 for the other scalings)."""
    if scaling is None or scaling.rope_type != "yarn":
        return 1.0
    if scaling.attention_factor is not None:
        return scaling.attention_factor
    if scaling.mscale and scaling.mscale_all_dim:
        return yarn_mscale(scaling.factor, scaling.mscale) / yarn_mscale(scaling.factor, scaling.mscale_all_dim)
    return yarn_mscale(scaling.factor)


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
        cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
        scale = angle_scale(scaling)
        self.register_buffer("cos_sin", cos_sin if scale == 1.0 else cos_sin * scale, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return pointwise.rotary(positions, self.cos_sin, q, k)

    def rotate_and_store(self, positions, q, k, v, kv_cache, slot_mapping,
                         qk_norm=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates q and k and writes the rotated k, and v, to their KV cache slots (one kernel on a GPU).
        `qk_norm` (q's RMSNorm, k's): each head normalised first, in the same kernel."""
        norms = None if qk_norm is None else (qk_norm[0].weight, qk_norm[1].weight, qk_norm[0].eps)
        return pointwise.rotary_store(positions, self.cos_sin, q, k, v, kv_cache, slot_mapping, norms)
