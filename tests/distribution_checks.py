"""Chi-squared checks that draws follow the distribution they claim to."""
from __future__ import annotations

import math

import torch


def chi2_999(dof: int) -> float:
    z = 3.090  # Wilson-Hilferty approximation of the 0.999 quantile
    return dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3


def assert_drawn_from(tokens: list[int], p: torch.Tensor) -> None:
    counts = torch.bincount(torch.tensor(tokens), minlength=len(p)).double()
    expected = p.double() * len(tokens)
    assert counts[expected == 0].sum() == 0, "a token the target gives no mass was emitted"
    cells = expected > 5
    chi2 = ((counts - expected)[cells] ** 2 / expected[cells]).sum().item()
    assert chi2 < chi2_999(int(cells.sum()) - 1), f"chi2={chi2:.1f} over {len(tokens)} draws"
