"""Brute-force references of the merge engine's statistics (:mod:`symgraph.merging.engine.statistics`),
on a model loaded whole, for the tests to compare the out-of-core takers with: RegMean's input
Grams by the traced graph run on the model's tensors, and Fisher's squared gradients by the
eager model's backward pass, each moved into the anchor's basis as the engine measures it."""
from __future__ import annotations

import torch

from symgraph.alignment.checks import batch_inputs, by_shape
from symgraph.alignment.graphrun import GraphRunner
from symgraph.core import distributed
from symgraph.merging.engine.statistics import InputGrams, SquaredGradients


def input_grams(model, report, data) -> dict:
    """Per linear weight of ``report`` (traced from a model of ``model``'s architecture), the
    Gram ``Σ x xᵀ`` (float64) of its input over ``data``, the graph run on ``model``'s own
    tensors; summed over the processes under ``torch.distributed``."""
    grams: dict = {}
    for (rep,), batches in by_shape((report,), (model,), data):  # other shapes: traced again
        layers = rep.linear_layers()
        names = {x for _, x, _, _ in layers}
        runner = GraphRunner(rep.exported_program.module())
        values = runner.state({**dict(model.named_buffers()), **dict(model.named_parameters())})
        for i, batch in batches:
            args, kwargs = batch_inputs(rep, batch, i)
            cap: dict = {}
            with torch.no_grad():
                torch.func.functional_call(runner, values, (names, cap, args, kwargs), strict=True, tie_weights=False)
            for w, x, _, _ in layers:
                if x in cap:
                    X = cap[x].double().reshape(-1, cap[x].shape[-1])
                    grams[w] = grams.get(w, 0) + X.T @ X
    return distributed.all_reduce_dict(grams)


def squared_gradients(model, report, data, loss) -> dict:
    """Per parameter, ``Σ_batches (∂ loss(logits) / ∂ w)²`` (float64) of the eager ``model``
    in eval mode; summed over the processes under ``torch.distributed``."""
    params = dict(model.named_parameters())
    out = {k: torch.zeros_like(p, dtype=torch.float64) for k, p in params.items()}
    was = model.training
    model.eval()
    try:
        for i, batch in enumerate(data):
            args, kwargs = batch_inputs(report, batch, i, check_shapes=False)  # run eagerly
            model.zero_grad(set_to_none=True)
            loss(_logits(model(*args, **kwargs))).backward()
            for k, p in params.items():
                if p.grad is not None:
                    out[k] += p.grad.detach().double() ** 2
        model.zero_grad(set_to_none=True)
    finally:
        model.train(was)
    return distributed.all_reduce_dict(out)


def of_kind(kind, model, report, data) -> dict:
    """``kind``'s statistic of ``model`` in its own basis (``report`` its analysis)."""
    if isinstance(kind, InputGrams):
        return input_grams(model, report, data)
    assert isinstance(kind, SquaredGradients), kind
    return squared_gradients(model, report, data, kind.loss)


def in_anchor_basis(kind, model, report, alignment, anchor_report, data) -> dict:
    """``kind``'s statistic of ``model`` in the anchor's basis: where norm gains fold, measured
    on the aligned model through the anchor's report (B's gains carried into A's, which no map
    of the statistic expresses); else in the model's own basis, moved by ``kind.to_anchor``."""
    if alignment is not None and anchor_report.folds:
        return of_kind(kind, alignment.apply(model), anchor_report, data)
    return kind.to_anchor(of_kind(kind, model, report, data), alignment)


def _logits(out):
    if isinstance(out, torch.Tensor):
        return out
    if hasattr(out, "logits"):
        return out.logits
    return out[0] if isinstance(out, (tuple, list)) else next(iter(out.values()))
