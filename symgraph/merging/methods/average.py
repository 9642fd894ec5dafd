"""Weighted averaging of the aligned weights."""
from __future__ import annotations

from .registry import MergeMethod, register

__all__ = ['Average']


@register("average")
class Average(MergeMethod):
    def combine_group(self, names, values, stats, weights, report):
        return {k: sum(w * v[k] for w, v in zip(weights, values)) for k in names}
