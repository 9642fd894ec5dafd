"""The finiteness check every reader of weights shares."""
from __future__ import annotations

import torch

__all__ = ["all_finite"]


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite: one float32 (float64) sum when it is finite (a
    NaN or inf makes the sum one), else value by value (the sum may only have overflowed).
    Integer tensors are finite."""
    if not t.is_floating_point():
        return True
    return bool(torch.isfinite(t.sum(dtype=torch.promote_types(t.dtype, torch.float32)))) or bool(
        torch.isfinite(t).all())
