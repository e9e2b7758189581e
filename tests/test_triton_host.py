"""Host-side logic of the Triton kernels, where Triton is installed (GPU machines; CI's CPU machine has none)."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")


def test_several_row_gemvs_trigger_their_dependents_exactly_once():
    # A kernel launched with programmatic dependent launch must trigger once; with none, the next kernel waits
    # for this one to finish before it can even launch. The kernel triggers in its main loop where
    # k0 == trigger_column (k0 = block_k, 2 block_k, ... < width) or after the loop where trigger_column >= width.
    from specserve.layers.triton_gemv import _trigger_column

    for block_k in (64, 128, 256, 512):
        for width in range(1, 5000, 37):
            loop = range(block_k, width, block_k)
            for fraction in (1e-6, 0.1, 0.5, 0.75, 0.9, 0.999, 1.0):
                column = _trigger_column(width, block_k, fraction)
                triggers = sum(k0 == column for k0 in loop) + (column >= width)
                assert triggers == 1, (width, block_k, fraction, column)
    # How far in: 4096 wide in steps of 256 (the step before the loop is the first): after 12 of 16 at 0.75.
    assert _trigger_column(4096, 256, 0.75) == 11 * 256
    assert _trigger_column(4096, 256, 1.0) == 4096
