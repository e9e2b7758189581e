"""Weight-only fp8 (e4m3, one fp32 scale per weight row) and its PyTorch matmul.

The Triton GEMV (kernels/triton/gemv.py) reads fp8 weights as they are and scales its sums; `dense_linear` is
the PyTorch form it is held to, and what calls it does not take run.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn  # weights only (a draft model's: --speculative-draft-model-quantization fp8)


def quantize_fp8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] -> (fp8 e4m3 [N, K], fp32 scales [N]): each row's largest magnitude maps to e4m3's largest
    value (a row of zeros gets the smallest scale, not a division by zero)."""
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1).clamp(min=torch.finfo(torch.float32).tiny) / torch.finfo(FP8).max
    return (weight / scale[:, None]).to(FP8), scale


def fp8_values(quantized: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp32 values an fp8 weight holds: each row's e4m3 numbers times its scale (`quantize_fp8_rows`)."""
    return quantized.float() * scale[:, None]


def dense_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight^T by PyTorch; an fp8 weight (with its per-row `scale`) is first widened to its values in x's
    dtype, scaled in fp32 (scaling the sums instead would hold sums of unscaled e4m3 values in x's dtype, which
    overflow fp16). It reads the fp8 weight and writes and reads a 16-bit one: more bytes than a 16-bit weight,
    so it serves calls the GEMV does not take (more than 16 rows, or where cuBLAS was chosen)."""
    if scale is None:
        return F.linear(x, weight)
    return F.linear(x, fp8_values(weight, scale).to(x.dtype))
