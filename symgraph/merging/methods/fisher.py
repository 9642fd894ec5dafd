"""Fisher merging: a per-coordinate average weighted by each model's diagonal Fisher of its
own predictive distribution (:func:`predictive_nll`'s squared gradients, which the engine
takes: :class:`~symgraph.merging.engine.statistics.SquaredGradients`, moved into the anchor's
basis with the squared map and, under ``torch.distributed``, summed over the processes' shards
of the data)."""
from __future__ import annotations

import torch
from pydantic import Field

from ..engine.statistics import SquaredGradients
from .average import weighted_sum
from .registry import MergeMethod, MethodParameters, register

__all__ = ['Fisher', 'predictive_nll']


def predictive_nll(logits):
    """The model's negative log-likelihood of its own most likely labels (the empirical
    Fisher of its predictive distribution at its argmax)."""
    logp = torch.log_softmax(logits.float(), -1)
    return -(logp.gather(-1, logp.argmax(-1, keepdim=True))).sum()


@register("fisher")
class Fisher(MergeMethod):
    statistic = SquaredGradients(loss=predictive_nll)

    class Parameters(MethodParameters):
        eps: float = Field(1e-12, ge=0, allow_inf_nan=False,
                           description="a number >= 0 added to every Fisher value, so coordinates no model's "
                                       "data moves are averaged by the weights (so they are at 0 too)")

    def combine_group(self, names, values, stats, weights, report):
        # Σ wᵢ (Fᵢ + ε) θᵢ / Σ wᵢ (Fᵢ + ε), three buffers at a time (each model's
        # term made in place: the same values, bit for bit, as the expression written out)
        out = {}
        for k in names:
            if not all(k in f for f in stats):  # no gradient (a buffer: running statistics): averaged
                out[k] = weighted_sum(weights, [v[k] for v in values])
                continue
            num = den = None
            for w, f, v in zip(weights, stats, values):
                t = (f[k] + self.eps).mul_(w)
                den = t.clone() if den is None else den.add_(t)
                t.mul_(v[k])
                num = t if num is None else num.add_(t)
            out[k] = num.div_(den)
            unseen = den == 0  # eps = 0 and no model's data moves it: 0/0, averaged by the weights instead
            if unseen.any():
                out[k] = torch.where(unseen, weighted_sum(weights, [v[k] for v in values]), out[k])
        return out

