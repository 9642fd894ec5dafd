"""Sums the weight similarity keeps: slot contributions added in place into a tensor it owns,
the Cauchy–Schwarz bounds beside them, and the exact norm those bounds are made of."""
from __future__ import annotations

import torch

__all__ = ["OwnedSum", "add_into", "settled", "frobenius", "plus_bound"]


def frobenius(x) -> float:
    """``‖x‖_F`` in float64 (``torch.linalg.vector_norm`` of a float32 or bfloat16 tensor of 64M
    elements is off by 0.5%), a slice of about 1M elements converted at a time, in the storage's
    order (the norm does not depend on the order of the dims)."""
    if x.numel() == 0:
        return 0.0
    if x.dim() == 0:
        return abs(float(x))
    if not x.is_contiguous():
        x = x.permute(*sorted(range(x.dim()), key=lambda k: -x.stride(k)))
    row = max(1, x[0].numel())
    # 8 MiB slices through one buffer: few operations (each costs ~0.1 ms on a thread of
    # in_turn's, whatever its size), no fresh pages per slice
    step = max(1, (1 << 20) // row)
    buf = torch.empty(min(step, x.shape[0]) * row, dtype=torch.float64, device=x.device)
    total = torch.zeros((), dtype=torch.float64, device=x.device)
    for i in range(0, x.shape[0], step):
        part = x[i:i + step]
        c = buf[:part.numel()].view(part.shape)
        c.copy_(part)
        total += torch.dot(c.view(-1), c.view(-1))
    return float(total) ** 0.5


class OwnedSum:
    """A sum :meth:`~.weights.WeightFeatures.similarity` owns (it made the tensor): added to in place."""
    __slots__ = ("value",)

    def __init__(self, value):
        self.value = value


def add_into(total, s):
    """``total + s`` at least in float32 (a slot's contribution of 16-bit weights comes in their
    dtype, the sum as before: each addition rounded in float32), in place once the sum is a
    tensor of our own (:class:`OwnedSum`): no new n×n tensor per slot (an MLP's: 127 MB at
    n = 5632). ``s`` itself and cached sums are never changed."""
    if total is None:
        return s if s.dtype.is_floating_point and s.element_size() >= 4 else OwnedSum(s.float())
    if isinstance(total, OwnedSum):
        total.value.add_(s)
        return total
    return OwnedSum(total + s)  # (a total not our own is s of an earlier slot, in float32 or wider)


def settled(total):
    """The tensor of a sum :func:`add_into` built (None, a tensor it did not copy, or its own)."""
    return total.value if isinstance(total, OwnedSum) else total


def plus_bound(bound, f):
    """A bound plus a contribution's (None, unknown, stays unknown)."""
    return None if bound is None or f is None else bound + f
