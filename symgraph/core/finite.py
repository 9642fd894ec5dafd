"""The finiteness check every reader of weights shares."""
from __future__ import annotations

import torch

from ..errors import InputError

__all__ = ["all_finite", "check_read"]


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite: its smallest and largest values are (an inf is
    one of them; a NaN makes both NaN: PyTorch's min/max reductions propagate NaN). One pass in
    ``t``'s own dtype, no float32 copy (a float32 sum of a 16-bit tensor runs about 20× slower).
    Integer and empty tensors are finite."""
    if not t.is_floating_point() or t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


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
