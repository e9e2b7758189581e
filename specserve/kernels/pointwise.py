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

from specserve.kernels.cpu import build as cpu_kernels


def _cpu_kernels(x: torch.Tensor, last_dim_multiple: int = 8):
    """The compiled CPU kernels if they apply to `x`: fp32 on CPU, no autograd, a vector-friendly width."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or torch.is_grad_enabled():
        return None
    if x.shape[-1] % last_dim_multiple:
        return None
    return cpu_kernels.kernels()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm of x; with `residual`, of the residual stream x + residual, returning (normed, x + residual)."""
    if residual is not None:
        x = x + residual
        return rms_norm(x, weight, eps), x
    kernels = _cpu_kernels(x)
    if kernels is not None and weight.dtype == torch.float32:
        return kernels.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
    # Normalise in fp32 like the reference implementation, then scale in the model dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rms_norm_pair(a: torch.Tensor, weight_a: torch.Tensor, b: torch.Tensor, weight_b: torch.Tensor,
                  eps: float, a_rows: torch.Tensor | None = None) -> torch.Tensor:
    """[RMSNorm(a) | RMSNorm(b)] along the last dimension: an EAGLE-3 head's input. With `a_rows`, a is a table
    (the token embedding) and its rows a_rows take a's place (on a GPU the lookup is then part of the kernel)."""
    if a_rows is not None:
        a = F.embedding(a_rows, a)
    return torch.cat([rms_norm(a, weight_a, eps), rms_norm(b, weight_b, eps)], dim=-1)


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


def rotary_store(positions: torch.Tensor, cos_sin: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor):
    """Rotates q and k like `rotary` and writes the rotated k and v [T, Hkv, D] into kv_cache
    [2, slots, Hkv, D] at `slot_mapping`. Returns the rotated (q, k)."""
    q, k = rotary(positions, cos_sin, q, k)
    kv_cache[0].index_copy_(0, slot_mapping, k)
    kv_cache[1].index_copy_(0, slot_mapping, v)
    return q, k


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    kernels = _cpu_kernels(gate_up, last_dim_multiple=16)
    if kernels is not None and gate_up.dim() == 2:
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


_EAGER = {"rms_norm": rms_norm, "rms_norm_pair": rms_norm_pair, "rotary": rotary, "rotary_store": rotary_store,
          "silu_and_mul": silu_and_mul}


def use_gpu_kernels() -> None:
    """GPU only: RMSNorm (with the residual add folded in; two of them side by side), the rotary embedding
    (with the KV store folded in) and SiLU-and-multiply become Triton kernels (layers/triton_pointwise.py).
    Calls that need gradients (draft-head training) and calls on CPU tensors keep the eager functions."""
    from specserve.kernels.triton import pointwise as triton_pointwise

    fast = {"rms_norm": _if(_same_dtypes, triton_pointwise.rms_norm),
            "rms_norm_pair": _if(_pair_same_dtypes, triton_pointwise.rms_norm_pair),
            "rotary": _if(_half_power_of_two, triton_pointwise.rotary),
            "rotary_store": _if(_rotary_store_fits, triton_pointwise.rotary_store),
            "silu_and_mul": triton_pointwise.silu_and_mul}
    for name, kernel in fast.items():
        globals()[name] = _unless_grad_or_cpu(kernel, _EAGER[name])


def _if(applies, kernel):
    """The kernel where `applies(*args)`, else the eager function of the same name."""
    eager = _EAGER[kernel.__name__]

    def dispatch(*args, **kwargs):
        return kernel(*args, **kwargs) if applies(*args, **kwargs) else eager(*args, **kwargs)
    return dispatch


def _same_dtypes(x, weight, eps, residual=None) -> bool:
    # Eager promotes a bf16 x with an fp32 weight to fp32; the kernel writes x's dtype.
    return x.dtype == weight.dtype and (residual is None or residual.dtype == x.dtype)


def _pair_same_dtypes(a, weight_a, b, weight_b, eps, a_rows=None) -> bool:
    shape_a = a.shape if a_rows is None else (*a_rows.shape, a.shape[-1])
    return a.dtype == weight_a.dtype == b.dtype == weight_b.dtype and shape_a == b.shape


def _half_power_of_two(positions, cos_sin, q, *rest) -> bool:
    half = q.shape[-1] // 2  # the rotary kernels tile half a head
    return half > 0 and not half & (half - 1)


def _rotary_store_fits(positions, cos_sin, q, k, v, kv_cache, slot_mapping) -> bool:
    """The kernel reads unit-stride heads and copies k and v into the cache without converting them."""
    return (_half_power_of_two(positions, cos_sin, q) and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
            and k.dtype == v.dtype == kv_cache.dtype and kv_cache.stride(-1) == 1
            and kv_cache.stride(-2) == kv_cache.shape[-1])


def _unless_grad_or_cpu(kernel, eager):
    def dispatch(x, *args, **kwargs):
        if torch.is_grad_enabled() or not x.is_cuda:
            return eager(x, *args, **kwargs)
        return kernel(x, *args, **kwargs)
    return dispatch
