"""Weighted averaging of the aligned weights."""
from __future__ import annotations

import torch

from .registry import MergeMethod, register

__all__ = ['Average', 'weighted_sum']


@register("average")
class Average(MergeMethod):

    def combine_group(self, names, values, stats, weights, report):
        return {k: weighted_sum(weights, [v[k] for v in values]) for k in names}


def weighted_sum(weights, tensors):
    """``sum(w * t ...)`` bit for bit (each product rounded, added in order, starting from 0: a
    sum of negative zeros is +0), into one new tensor rather than one per product and per sum."""
    out = None
    for w, t in zip(weights, tensors):
        if out is None:
            out = torch.mul(t, w).add_(0)  # 0 + w·t, as sum() starts: -0.0 becomes +0.0
        else:
            out.add_(torch.mul(t, w))
    return out
