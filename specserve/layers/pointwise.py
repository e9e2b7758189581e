"""The elementwise math between the matmuls, as plain functions the layers call through this module.

Eager PyTorch runs each of these as several small kernels; on a GPU decode step, where every kernel is tiny,
those launches add up to more time than the weights take to read. `compile_pointwise()` swaps in
torch.compile'd versions (one fused Triton kernel each); the math, and so the output, is the same.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 like the reference implementation, then scale in the model dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotary(positions: torch.Tensor, cos_sin: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    """Rotate-half rotary embedding of q [T, H, D] and k [T, Hkv, D] at `positions`, angles in fp32."""
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


_EAGER = {"rms_norm": rms_norm, "rotary": rotary, "silu_and_mul": silu_and_mul}


def compile_pointwise() -> None:
    """Fuses each function above into one kernel (GPU only). Shapes are dynamic, but a size of 1, a dtype
    or an eps value each get their own compile; past the limit a call simply runs eagerly."""
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    for name, fn in _EAGER.items():
        globals()[name] = torch.compile(fn, dynamic=True)
