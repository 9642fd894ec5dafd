"""Fisher merging: a per-coordinate average weighted by each model's diagonal Fisher of its
own predictive distribution. The Fisher moves into the anchor's basis with the squared map.
Under ``torch.distributed`` the sums of squared gradients are all-reduced over the processes'
shards of the data (:mod:`symgraph.core.distributed`)."""
from __future__ import annotations

import torch
from pydantic import Field

from ...core import distributed
from ...alignment.checks import batch_inputs
from ...transform.apply import map_parameters
from ...errors import InputError
from ..backprop import budget_floor, squared_gradients
from .registry import MergeMethod, MethodParameters, register

__all__ = ['Fisher']


@register("fisher")
class Fisher(MergeMethod):
    needs_data = True

    class Parameters(MethodParameters):
        eps: float = Field(1e-12, ge=0, allow_inf_nan=False,
                           description="a number >= 0 added to every Fisher value, so coordinates no model's "
                                       "data moves are averaged by the weights")

    def statistics(self, model, report, data):
        params = dict(model.named_parameters())
        fis = {k: torch.zeros_like(p, dtype=torch.float64) for k, p in params.items()}
        was = model.training
        model.eval()
        try:
            for i, batch in enumerate(data):
                args, kwargs = batch_inputs(report, batch, i, check_shapes=False)  # run eagerly
                model.zero_grad(set_to_none=True)
                self.loss(_logits(model(*args, **kwargs))).backward()
                for k, p in params.items():
                    if p.grad is not None:
                        fis[k] += p.grad.detach().double() ** 2
            model.zero_grad(set_to_none=True)
        finally:
            model.train(was)
        return distributed.all_reduce_dict(fis)  # sums over every process's batches

    @staticmethod
    def loss(logits):
        """The model's negative log-likelihood of its own most likely labels (the empirical
        Fisher of its predictive distribution at its argmax)."""
        logp = torch.log_softmax(logits.float(), -1)
        return -(logp.gather(-1, logp.argmax(-1, keepdim=True))).sum()

    def to_anchor(self, stat, alignment):
        if alignment is None:
            return stat
        rb = alignment.report_b
        moved = map_parameters(rb, alignment.elements,
                               {k: v for k, v in stat.items() if k in set(rb.parameters)}, squared=True)
        return {**stat, **moved}

    def streamed_statistics(self, job, i):
        return squared_gradients(job, i, self, f"fisher/{i}/")

    def statistics_floor(self, job):
        need, weight = budget_floor(job)
        return need, f"its squared gradients' largest op (reading {weight!r}), with the values kept at the cuts"

    def combine_group(self, names, values, stats, weights, report):
        # Σ wᵢ (Fᵢ + ε) θᵢ / Σ wᵢ (Fᵢ + ε), three buffers at a time (each model's
        # term made in place: the same values, bit for bit, as the expression written out)
        out = {}
        for k in names:
            num = den = None
            for w, f, v in zip(weights, stats, values):
                t = (f[k] + self.eps).mul_(w)
                den = t.clone() if den is None else den.add_(t)
                t.mul_(v[k])
                num = t if num is None else num.add_(t)
            out[k] = num.div_(den)
        return out


def _logits(out):
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    if isinstance(out, (tuple, list)):
        return out[0]
    if isinstance(out, dict):
        return next(iter(out.values()))
    raise InputError("cannot find the model's output tensor for Fisher statistics")
