"""RegMean: per linear layer, ``W* = (Σ wᵢ Wᵢ Gᵢ + εW̄)(Σ wᵢ Gᵢ + εI)⁻¹`` with ``Gᵢ`` the Gram matrix
of the layer's inputs in model i, regularised towards its diagonal, and a ridge ``ε`` towards the
average ``W̄`` (inputs the data never reaches keep it); other parameters are averaged.
The Grams are the engine's :class:`~symgraph.merging.engine.statistics.InputGrams`, taken of
each model carried into the anchor's basis (summed over the processes' shards of the data under
``torch.distributed``)."""
from __future__ import annotations

import math
import weakref

import torch
from pydantic import Field

from ..engine.statistics import InputGrams
from .average import Average
from .registry import MethodParameters, register

__all__ = ['RegMean']

#: The ridge each Gram sum gets, towards the weights' average (an input the data never reaches).
RIDGE = 1e-8


@register("regmean")
class RegMean(Average):
    statistic = InputGrams()  # a Gram over each weight's inputs: read whole for any slice

    class Parameters(MethodParameters):
        alpha: float = Field(0.9, ge=0, le=1, allow_inf_nan=False,
                             description="a number in [0, 1]: each Gram is alpha G + (1 - alpha) diag(G), "
                                         "1 the plain Gram, 0 its diagonal alone")

    def sliceable(self, name, dim, report):
        """A linear weight is merged in slices along its outputs only (its Gram is over its inputs)."""
        return all(dim == (0 if layout == "out_in" else 1) for w, _, _, layout in _layers(report) if w == name)

    def held_bytes(self, name, shape, item, n, report):
        """Besides the copies: each model's float64 Gram over a linear weight's inputs (read
        whole for any slice), and the weight's solve in float64."""
        ins = [shape[1 if layout == "out_in" else 0] for w, _, _, layout in _layers(report) if w == name]
        held = super().held_bytes(name, shape, item, n, report)
        return held + sum(8 * n * i * i + (8 - item) * math.prod(shape) for i in ins)

    def combine_group(self, names, values, stats, weights, report):
        merged = super().combine_group(names, values, stats, weights, report)
        a, wanted, done = self.alpha, set(names), set()
        for w, _, _, layout in _layers(report):
            if w not in wanted or w in done or not all(w in g for g in stats):
                continue
            done.add(w)
            # (Σ wᵢ Wᵢ Gᵢ)(Σ wᵢ Gᵢ)⁻¹ with Gᵢ ← α Gᵢ + (1 − α) diag(Gᵢ), one Gram held at a time
            # besides the sum (each is read, regularised and scaled in place; the same values,
            # bit for bit, as the expressions written out)
            num = den = None
            for wi, v, g in zip(weights, values, stats):
                G = g[w]
                d = G.diagonal().clone()
                G.mul_(a).diagonal().add_(d.mul_(1 - a))
                W = (v[w] if layout == "out_in" else v[w].T).to(G.dtype)
                t = wi * W @ G
                num = t if num is None else num.add_(t)
                del t, W
                den = G.mul_(wi) if den is None else den.add_(G.mul_(wi))
                del G
            # a ridge towards the average, not towards zero: an input no model's data reaches
            # (a unit that never fires) keeps the averaged column, and equal models are kept
            avg = merged[w] if layout == "out_in" else merged[w].T
            den.diagonal().add_(RIDGE)
            num.add_(avg.to(num.dtype), alpha=RIDGE)
            Wm = torch.linalg.solve(den.T, num.T).T
            merged[w] = Wm if layout == "out_in" else Wm.T
        return merged


_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _layers(report) -> list:
    """``report.linear_layers()``, computed once per report (the combine asks per group)."""
    if report is None:
        return []
    if report not in _LAYERS:
        _LAYERS[report] = report.linear_layers()
    return _LAYERS[report]
