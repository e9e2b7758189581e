"""Host-to-device copies that never make the host wait for the device.

A copy from ordinary (pageable) host memory synchronises with the stream first, so the host would stall until
the step in flight finishes and overlap scheduling would be lost. Staging through pinned memory lets the copy
queue behind the running step instead.
"""
from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def tensor_on(values, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    return to_device(torch.tensor(values, dtype=dtype), device)
