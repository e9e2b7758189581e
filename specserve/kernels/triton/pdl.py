"""Programmatic dependent launch (Hopper and later) for the Triton kernels of a decode step.

A batch-1 decode step of an 8B model is ~260 short kernels in a row, each waiting for the one before to
finish, drain and hand over before its own blocks are even scheduled. With PDL a kernel is launched while
its predecessor is still running: its blocks start, read what does not depend on the predecessor (weights),
and wait at `gdc_wait` for the predecessor to complete and its writes to be visible. Every kernel launched
this way must call `gdc_wait` before it reads anything an earlier kernel wrote, and before it writes
anything (a buffer it writes may still be read by the predecessor); the kernels here all do.

Triton has the instructions from 3.4 on; with an older one (torch < 2.8) the kernels run without PDL.
"""
from __future__ import annotations

import functools

import torch
import triton

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    AVAILABLE = True
except ImportError:  # the kernels only call these under `if PDL:`, which is then always False
    AVAILABLE = False

    @triton.jit
    def gdc_wait():
        pass

    @triton.jit
    def gdc_launch_dependents():
        pass

__all__ = ["gdc_launch_dependents", "gdc_wait", "launch_options"]


@functools.cache
def enabled(device_index: int) -> bool:
    return AVAILABLE and torch.cuda.get_device_capability(device_index) >= (9, 0)


def launch_options(t: torch.Tensor) -> dict:
    """Keyword arguments for a kernel launch on t's device: the PDL flag (where Triton knows it) and the
    matching constexpr."""
    if t.device.type != "cuda":  # Triton's interpreter, on a CPU
        return {"PDL": False}
    on = enabled(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return {"launch_pdl": True, "PDL": True} if on else {"PDL": False}
