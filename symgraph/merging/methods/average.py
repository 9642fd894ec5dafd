"""Weighted averaging of the aligned weights."""
from __future__ import annotations

import torch

from .registry import MergeMethod, register

__all__ = ['Average']


@register("average")
class Average(MergeMethod):
    def combine_group(self, names, values, stats, weights, report):
        return {k: _weighted_sum(weights, [v[k] for v in values]) for k in names}


def _weighted_sum(weights, tensors):
    """``Σ w_i t_i``, each product rounded and added in order as ``sum(w * t ...)`` does, into
    one new tensor (not one per product and per sum: two passes fewer over each tensor)."""
    out = None
    for w, t in zip(weights, tensors):
        if out is None:
            out = t * w
        else:
            out.add_(torch.mul(t, w))
    return out
