"""The finiteness check every reader of weights shares."""
from __future__ import annotations

import torch

from ..errors import InputError

__all__ = ["all_finite", "check_read"]


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite: one float32 (float64) sum when it is finite (a
    NaN or inf makes the sum one), else value by value (the sum may only have overflowed).
    Integer tensors are finite."""
    if not t.is_floating_point():
        return True
    return bool(torch.isfinite(t.sum(dtype=torch.promote_types(t.dtype, torch.float32)))) or bool(
        torch.isfinite(t).all())


def check_read(t: torch.Tensor, key: str, seen: set, whole: bool, where: str) -> None:
    """Refuse a read tensor ``key`` of ``where`` (e.g. ``"checkpoint 'dir'"``) with NaN or inf
    values; a whole tensor found finite is added to ``seen`` and not checked again."""
    if not t.is_floating_point() or (whole and key in seen):
        return
    if not all_finite(t):
        bad = int((~torch.isfinite(t)).sum())
        raise InputError(f"{where} has {bad} NaN/inf values in tensor {key!r}; expected finite weights "
                         "(was the model trained with a diverging loss?)")
    if whole:
        seen.add(key)
