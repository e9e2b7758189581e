"""The elementwise math between the matmuls, as plain functions the layers call through this module.

Eager PyTorch runs each of these as several small kernels; on a GPU decode step, where every kernel is tiny,
those launches add up to more time than the weights take to read. `use_gpu_kernels()` swaps in one fused
kernel each; the math, and so the output, is the same up to rounding order.
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


def use_gpu_kernels() -> None:
    """GPU only: the rotary embedding and SiLU-and-multiply become Triton kernels (layers/triton_pointwise.py)
    and RMSNorm one torch.compile'd kernel (shapes are dynamic, but a size of 1, a dtype or an eps value each
    get their own compile; past the limit a call runs eagerly). Calls that need gradients (draft-head
    training) and calls on CPU tensors keep the eager functions."""
    import torch._dynamo

    from specserve.layers import triton_pointwise

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    fast = {"rms_norm": torch.compile(_EAGER["rms_norm"], dynamic=True),
            "rotary": _rotary_if_supported(triton_pointwise.rotary),
            "silu_and_mul": triton_pointwise.silu_and_mul}
    for name, kernel in fast.items():
        globals()[name] = _unless_grad_or_cpu(kernel, _EAGER[name])


def _rotary_if_supported(kernel):
    def rotary_fn(positions, cos_sin, q, k):
        half = q.shape[-1] // 2
        if half & (half - 1):  # the kernel tiles half a head, which must be a power of two
            return _EAGER["rotary"](positions, cos_sin, q, k)
        return kernel(positions, cos_sin, q, k)
    return rotary_fn


def _unless_grad_or_cpu(kernel, eager):
    def dispatch(x, *args):
        if torch.is_grad_enabled() or not x.is_cuda:
            return eager(x, *args)
        return kernel(x, *args)
    return dispatch
