"""RegMean: per linear layer, ``W* = (Σ wᵢ Wᵢ Gᵢ)(Σ wᵢ Gᵢ)⁻¹`` with ``Gᵢ`` the Gram matrix of the
layer's inputs in model i, regularised towards its diagonal; other parameters are averaged.
A Gram ``G = Σ x xᵀ`` moves into the anchor's basis as ``M G Mᵀ``. Under ``torch.distributed``
the Grams are all-reduced over the processes' shards of the data (:mod:`symgraph.core.distributed`)."""
from __future__ import annotations

import math
import weakref

import torch
from pydantic import Field

from ...core import distributed
from ...alignment.graphrun import GraphRunner
from ...alignment.checks import batch_inputs, by_shape
from ..statistics import input_grams
from .average import Average
from .registry import MethodParameters, register

__all__ = ['RegMean']


@register("regmean")
class RegMean(Average):
    needs_data = True

    class Parameters(MethodParameters):
        alpha: float = Field(0.9, ge=0, le=1, allow_inf_nan=False,
                             description="a number in [0, 1]: each Gram is alpha G + (1 - alpha) diag(G), "
                                         "1 the plain Gram, 0 its diagonal alone")

    def statistics(self, model, report, data):
        grams = {}
        for (rep,), batches in by_shape((report,), (model,), data):  # other shapes: traced again
            layers = rep.linear_layers()
            names = {x for _, x, _, _ in layers}
            # the graph runs on ``model``'s tensors (not those it was traced with): statistics
            # of an aligned copy measured with the anchor's report
            runner = GraphRunner(rep.exported_program.module())
            values = runner.state({**dict(model.named_buffers()), **dict(model.named_parameters())})
            for i, batch in batches:
                args, kwargs = batch_inputs(rep, batch, i)
                cap = {}
                with torch.no_grad():
                    torch.func.functional_call(runner, values, (names, cap, args, kwargs),
                                               strict=True, tie_weights=False)
                for w, x, _, _ in layers:
                    if x in cap:
                        X = cap[x].double().reshape(-1, cap[x].shape[-1])
                        grams[w] = grams.get(w, 0) + X.T @ X
        return distributed.all_reduce_dict(grams)  # sums over every process's batches

    def to_anchor(self, grams, alignment):
        if alignment is None:
            return grams
        rb = alignment.report_b
        out = {}
        for w, _, axis, _ in rb.linear_layers():
            if w not in grams:
                continue
            M, G = rb.axis_map(axis, alignment.elements), grams[w]
            if M is None:
                out[w] = G
            elif M.dim() == 1:  # a permutation's index vector
                out[w] = G[M][:, M]
            else:
                out[w] = M @ G @ M.T
        return out

    def streamed_statistics(self, job, i):
        return input_grams(job, i, f"regmean/{i}/")

    elementwise_statistics = False  # a Gram over the weight's inputs, never sliced with it

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
            den.diagonal().add_(1e-8)
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
