"""A Linear layer that can pre-pack its weight for oneDNN on CPU.

PyTorch's default fp32 GEMM re-lays-out the weight at every call, which dominates small-batch decode on CPU
(a 2-core EPYC spent 129 ms per SmolLM2 step at batch 8 in plain `F.linear`, 60 ms pre-packed). Packing
once at load keeps the same fp32 math and cuts that cost. GPUs and other dtypes use plain `F.linear`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    packed_weight: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is None:
            return F.linear(x, self.weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight, self.bias, "none", [], "")

    def prepack(self, max_batch_hint: int = 8) -> None:
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), max_batch_hint)


def can_prepack(model: nn.Module) -> bool:
    weight = next(model.parameters())
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and torch.backends.mkldnn.is_available()


def prepack_linears(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, Linear):
            module.prepack()
