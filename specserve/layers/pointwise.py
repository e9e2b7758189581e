"""The elementwise math between the matmuls, as plain functions the layers call through this module.

Eager PyTorch runs each of these as several small kernels; on a GPU decode step, where every kernel is tiny,
those launches add up to more time than the weights take to read. `use_gpu_kernels()` swaps in one fused
kernel each; the math, and so the output, is the same up to rounding order. On CPU, fp32 calls without
gradients go to the compiled kernels of cpu_kernels.py where they are built (fewer passes over memory, one
dispatch instead of several).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.layers import cpu_kernels


def _cpu_kernels(x: torch.Tensor, last_dim_multiple: int = 8):
    """The compiled CPU kernels if they apply to `x`: fp32 on CPU, no autograd, a vector-friendly width."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or torch.is_grad_enabled():
        return None
    if x.shape[-1] % last_dim_multiple:
        return None
    return cpu_kernels.kernels()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    kernels = _cpu_kernels(x)
    if kernels is not None and weight.dtype == torch.float32:
        return kernels.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
    # Normalise in fp32 like the reference implementation, then scale in the model dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotary(positions: torch.Tensor, cos_sin: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    """Rotate-half rotary embedding of q [T, H, D] and k [T, Hkv, D] at `positions`, angles in fp32.
    The CPU kernel rotates in place (q and k are fresh views of this step's projection)."""
    kernels = _cpu_kernels(q, last_dim_multiple=16)
    if (kernels is not None and k.dtype == torch.float32 and positions.dtype == torch.long
            and q.stride(-2) == k.stride(-2) == q.shape[-1]):
        kernels.rotary_(positions, cos_sin, q, k)
        return q, k
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    kernels = _cpu_kernels(gate_up, last_dim_multiple=16)
    if kernels is not None and gate_up.dim() == 2:
        return kernels.silu_and_mul(gate_up)
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
