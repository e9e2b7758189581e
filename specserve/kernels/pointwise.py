"""The elementwise math between the matmuls, as plain functions the layers call.

Each runs in one of two forms. On a GPU (CUDA tensors, no autograd: the kernels have no backward) a call takes
one fused Triton kernel of kernels/triton/pointwise.py where the kernel handles its dtypes and shapes: eager
PyTorch runs each of these as several small kernels, and in a decode step, where every kernel is tiny, those
launches add up to more time than the weights take to read. Elsewhere a call takes the PyTorch form,
`eager_<name>`, which the Triton kernels are held to (the same math, up to rounding order); on CPU its fp32
calls without gradients go to the compiled kernels of kernels/cpu where they are built (fewer passes over
memory, one dispatch instead of several).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from specserve.kernels.cpu import build as cpu_kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """RMSNorm of x; with `residual`, of the residual stream x + residual, returning (normed, x + residual)."""
    gpu = _gpu_kernels(x)
    # Eager promotes a bf16 x with an fp32 weight to fp32; the kernel writes x's dtype.
    if gpu is not None and x.dtype == weight.dtype and (residual is None or residual.dtype == x.dtype):
        return gpu.rms_norm(x, weight, eps, residual)
    return eager_rms_norm(x, weight, eps, residual)


def rms_norm_pair(a: torch.Tensor, weight_a: torch.Tensor, b: torch.Tensor, weight_b: torch.Tensor,
                  eps: float, a_rows: torch.Tensor | None = None) -> torch.Tensor:
    """[RMSNorm(a) | RMSNorm(b)] along the last dimension: an EAGLE-3 head's input. With `a_rows`, a is a table
    (the token embedding) and its rows a_rows take a's place (on a GPU the lookup is then part of the kernel)."""
    gpu = _gpu_kernels(a)
    shape_a = a.shape if a_rows is None else (*a_rows.shape, a.shape[-1])
    if gpu is not None and a.dtype == weight_a.dtype == b.dtype == weight_b.dtype and shape_a == b.shape:
        return gpu.rms_norm_pair(a, weight_a, b, weight_b, eps, a_rows)
    return _norm_pair(rms_norm, a, weight_a, b, weight_b, eps, a_rows)


def rotary(positions: torch.Tensor, cos_sin: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    """Rotate-half rotary embedding of q [T, H, D] and k [T, Hkv, D] at `positions`, angles in fp32."""
    gpu = _gpu_kernels(positions)
    if gpu is not None and _half_power_of_two(q):
        return gpu.rotary(positions, cos_sin, q, k)
    return eager_rotary(positions, cos_sin, q, k)


def rotary_store(positions: torch.Tensor, cos_sin: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None):
    """Rotates q and k like `rotary` and writes the rotated k and v [T, Hkv, D] into kv_cache
    [2, slots, Hkv, D] at `slot_mapping`. `qk_norm` (q's RMSNorm weight, k's, eps): each head of q and k is
    normalised before the rotation (Qwen3). Returns the rotated (q, k)."""
    gpu = _gpu_kernels(positions)
    # The kernel reads unit-stride heads and copies k and v into the cache without converting them.
    if (gpu is not None and _half_power_of_two(q) and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
            and k.dtype == v.dtype == kv_cache.dtype and kv_cache.stride(-1) == 1
            and kv_cache.stride(-2) == kv_cache.shape[-1]
            and (qk_norm is None or qk_norm[0].dtype == qk_norm[1].dtype == q.dtype == k.dtype)):
        return gpu.rotary_store(positions, cos_sin, q, k, v, kv_cache, slot_mapping, qk_norm)
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        q, k = rms_norm(q, q_weight, eps), rms_norm(k, k_weight, eps)
    return _store(*rotary(positions, cos_sin, q, k), v, kv_cache, slot_mapping)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> silu(gate) * up, [..., I]."""
    gpu = _gpu_kernels(gate_up)
    if gpu is not None:
        return gpu.silu_and_mul(gate_up)
    return eager_silu_and_mul(gate_up)


def _gpu_kernels(x: torch.Tensor):
    """kernels/triton/pointwise where a call on x may take a fused kernel, else None."""
    if torch.is_grad_enabled() or not x.is_cuda:
        return None
    return _triton_pointwise()


@functools.cache
def _triton_pointwise():
    try:  # imported at the first GPU call: CPU-only runs never load Triton
        from specserve.kernels.triton import pointwise
    except ImportError:
        return None
    return pointwise


def _half_power_of_two(q: torch.Tensor) -> bool:
    half = q.shape[-1] // 2  # the rotary kernels tile half a head
    return half > 0 and not half & (half - 1)


# -- the PyTorch forms ---------------------------------------------------------------------------------------


def _cpu_kernels(x: torch.Tensor, last_dim_multiple: int = 8):
    """The compiled CPU kernels if they apply to `x`: fp32 on CPU, no autograd, a vector-friendly width."""
    if x.device.type != "cpu" or x.dtype != torch.float32 or torch.is_grad_enabled():
        return None
    if x.shape[-1] % last_dim_multiple:
        return None
    return cpu_kernels.kernels()


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """`rms_norm` in PyTorch (or the CPU kernel)."""
    if residual is not None:
        x = x + residual
        return eager_rms_norm(x, weight, eps), x
    kernels = _cpu_kernels(x)
    if kernels is not None and weight.dtype == torch.float32:
        return kernels.rms_norm(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)
    # Normalise in fp32 like the reference implementation, then scale in the model dtype.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def eager_rms_norm_pair(a: torch.Tensor, weight_a: torch.Tensor, b: torch.Tensor, weight_b: torch.Tensor,
                        eps: float, a_rows: torch.Tensor | None = None) -> torch.Tensor:
    """`rms_norm_pair` in PyTorch: a lookup, two norms and a concatenation."""
    return _norm_pair(eager_rms_norm, a, weight_a, b, weight_b, eps, a_rows)


def _norm_pair(norm, a, weight_a, b, weight_b, eps, a_rows):
    if a_rows is not None:
        a = F.embedding(a_rows, a)
    return torch.cat([norm(a, weight_a, eps), norm(b, weight_b, eps)], dim=-1)


def eager_rotary(positions: torch.Tensor, cos_sin: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
    """`rotary` in PyTorch. The CPU kernel rotates in place (q and k are fresh views of this step's
    projection)."""
    kernels = _cpu_kernels(q, last_dim_multiple=16)
    if (kernels is not None and k.dtype == torch.float32 and positions.dtype == torch.long
            and q.stride(-2) == k.stride(-2) == q.shape[-1]):
        kernels.rotary_(positions, cos_sin, q, k)
        return q, k
    cos, sin = cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def eager_rotary_store(positions: torch.Tensor, cos_sin: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                       v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor):
    """`rotary_store` in PyTorch: the rotation, then two copies into the cache."""
    return _store(*eager_rotary(positions, cos_sin, q, k), v, kv_cache, slot_mapping)


def _store(q, k, v, kv_cache, slot_mapping):
    kv_cache[0].index_copy_(0, slot_mapping, k)
    kv_cache[1].index_copy_(0, slot_mapping, v)
    return q, k


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def eager_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu_and_mul` in PyTorch (or the CPU kernel)."""
    kernels = _cpu_kernels(gate_up, last_dim_multiple=16)
    if kernels is not None and gate_up.dim() == 2:
        return kernels.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
