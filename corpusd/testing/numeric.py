"""How far one tensor is from another: the one comparison the tests and the tools share."""

from __future__ import annotations

import torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative error ||a − b|| / ||b|| in float64 (any shapes that broadcast, any dtypes)."""
    a64, b64 = a.double(), b.double()
    return float((a64 - b64).norm() / b64.norm())
