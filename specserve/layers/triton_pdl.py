"""Programmatic dependent launch (Hopper and later) for the Triton kernels of a decode step.

A batch-1 decode step of an 8B model is ~260 short kernels in a row, each waiting for the one before to
finish, drain and hand over before its own blocks are even scheduled. With PDL a kernel is launched while
its predecessor is still running: its blocks start, read what does not depend on the predecessor (weights),
and wait at `gdc_wait` for the predecessor to complete and its writes to be visible. Every kernel launched
this way must call `gdc_wait` before it reads anything an earlier kernel wrote, and before it writes
anything (a buffer it writes may still be read by the predecessor); the kernels here all do.

SPECSERVE_PDL=0 turns it off (an A/B switch for benchmarks).
"""
from __future__ import annotations

import functools
import os

import torch


@functools.cache
def enabled(device_index: int) -> bool:
    return os.environ.get("SPECSERVE_PDL", "1") != "0" and torch.cuda.get_device_capability(device_index) >= (9, 0)


def launch_options(t: torch.Tensor) -> dict:
    """Keyword arguments for a kernel launch on t's device: the PDL flag, and the matching constexpr."""
    on = enabled(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return {"launch_pdl": on, "PDL": on}
