"""Weighted averaging of the aligned weights."""
from __future__ import annotations

from .registry import MergeMethod, register

__all__ = ['Average']


@register("average")
class Average(MergeMethod):
    def combine(self, states, stats, weights, report):
        return {k: sum(w * s[k] for w, s in zip(weights, states)) for k in states[0]}
