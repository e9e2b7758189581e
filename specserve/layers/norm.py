from __future__ import annotations

import torch

from specserve.kernels import pointwise


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """With `residual`: normalises x + residual and returns (normed, x + residual), one kernel on a GPU."""
        return pointwise.rms_norm(x, self.weight, self.eps, residual)
