"""REPAIR for BatchNorm nets: reset the merged model's BatchNorm running statistics on data.

A BatchNorm layer in eval mode normalises with its ``running_mean`` / ``running_var``. The
merge's are the weighted average of the parents' (in A's basis), but the merged layer's
input is not the average of the parents' inputs: its channels mix units that are only partly
correlated, and their variance on the data falls below the averaged ``running_var``
("variance collapse"). The REPAIR paper (Jordan et al., ICLR 2023) and Git Re-Basin
(Ainsworth et al., ICLR 2023) therefore *reset* the merged net's BatchNorm statistics: the
running statistics are recomputed on data for the merged model itself.

:func:`reset_batchnorm` does this exactly: for every BatchNorm module that tracks running
statistics (``torch.nn.modules.batchnorm._BatchNorm`` with ``track_running_stats``), in the
order the forward pass calls them, the population mean and the unbiased population variance
of its input over every sample of every batch (batch and spatial positions together, per
channel; float64 sums) become its ``running_mean`` / ``running_var``. Each layer is measured
in eval mode with the layers before it already reset (one pass over the data per layer, each
stopping once the layer has run), so every layer ends with the statistics of its input in
the final model. Nothing else changes: momentum, ``num_batches_tracked``, parameters and the
modules' train / eval modes are left (or put back) as they were. Under ``torch.distributed``
the sums and counts are all-reduced (:mod:`symgraph.core.distributed`).

:func:`repair` is what ``merge(..., repair=True)`` runs: without BatchNorm layers it is
:func:`~symgraph.merging.repair.renormalize`; with them, the BatchNorm statistics are reset,
then the channels that reach a nonlinearity with no normalisation first are renormalised (if
any), then the BatchNorm statistics are reset again, since those corrections move the inputs
of later BatchNorm layers. (A renormalised channel downstream of such a BatchNorm is then off
its target again by the second reset's change; exact when no renormalised channel feeds a
BatchNorm that feeds another renormalised channel.)
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ..core import distributed
from ..core.finite import require_finite
from ..errors import InputError
from .repair import RepairReport, find_sites, renormalize

__all__ = ["BatchNormReset", "batchnorm_layers", "reset_batchnorm", "repair"]


@dataclass
class BatchNormReset:
    """One reset BatchNorm module ``name`` with ``channels`` channels, measured on ``samples``
    values per channel. ``std_ratio``: the mean over its channels of ``σ_data / σ_running``
    before the reset (below 1: the merge's variance collapsed); ``mean_shift``: the mean of
    ``|μ_data − μ_running| / σ_data``."""
    name: str
    channels: int
    samples: int
    std_ratio: float
    mean_shift: float

    def to_dict(self):
        return dict(self.__dict__)


def batchnorm_layers(model) -> list:
    """Names of the BatchNorm modules of ``model`` with running statistics (registration order)."""
    return [n for n, m in model.named_modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats
            and m.running_mean is not None and m.running_var is not None]


class _Stop(Exception):  # raised in a hook once the measured layer has run for this batch
    pass


def _call(model, batch, device):
    """``model`` on one batch (a tuple / list of positional tensors, a dict of keyword
    tensors, or a tensor), moved to ``device``."""
    move = lambda v: v.to(device) if isinstance(v, torch.Tensor) else v  # noqa: E731
    if isinstance(batch, dict):
        return model(**{k: move(v) for k, v in batch.items()})
    if isinstance(batch, (tuple, list)):
        return model(*[move(v) for v in batch])
    if isinstance(batch, torch.Tensor):
        return model(move(batch))
    raise InputError(f"data batch is a {type(batch).__name__}; expected a tuple of tensors, a "
                     "dict of keyword tensors or a tensor")


def _hooked(model, names, hook):
    return [model.get_submodule(n).register_forward_pre_hook(
        lambda mod, args, n=n: hook(n, args[0])) for n in names]


def _call_order(model, names, batch, device) -> tuple:
    """The modules of ``names`` that the forward pass calls on ``batch``, in the order it first
    calls them, and how many times it calls each."""
    calls = []
    hooks = _hooked(model, names, lambda n, x: calls.append(n))
    try:
        _call(model, batch, device)
    finally:
        for h in hooks:
            h.remove()
    order = list(dict.fromkeys(calls))
    return order, {n: calls.count(n) for n in order}


def _measure(model, name, data, device, calls) -> dict:
    """Per-channel ``{"n", "sum", "sumsq"}`` (float64) of the input of module ``name`` over
    ``data``; each batch's run stops once the module has run ``calls`` times."""
    acc, seen = {"n": 0, "sum": 0, "sumsq": 0}, [0]

    def hook(n, x):
        x = x.detach().double().transpose(0, 1).reshape(x.shape[1], -1)
        acc["n"] += x.shape[1]
        acc["sum"] = acc["sum"] + x.sum(1)
        acc["sumsq"] = acc["sumsq"] + (x * x).sum(1)
        seen[0] += 1
        if seen[0] == calls:
            raise _Stop

    hooks = _hooked(model, [name], hook)
    try:
        for batch in data:
            seen[0] = 0
            try:
                _call(model, batch, device)
            except _Stop:
                pass
    finally:
        for h in hooks:
            h.remove()
    return distributed.all_reduce_dict(acc)


def reset_batchnorm(model, data, names=None) -> list:
    """Set the running statistics of ``model``'s BatchNorm modules (``names``, default
    :func:`batchnorm_layers`) to the exact population statistics of their inputs on ``data``
    (a list of batches), in place; returns one :class:`BatchNormReset` per module reset, in
    forward order (a module the model does not call on ``data[0]`` is left as it is). See the
    module docstring."""
    data = list(data) if data is not None else []
    if not data:
        raise InputError("resetting BatchNorm statistics needs data: a non-empty list of batches")
    names = batchnorm_layers(model) if names is None else list(names)
    if not names:
        return []
    device = model.get_submodule(names[0]).running_mean.device
    modes = {m: m.training for m in model.modules()}
    out = []
    try:
        model.eval()
        with torch.no_grad():
            order, calls = _call_order(model, names, data[0], device)
            for name in order:  # a module the forward pass never calls keeps its statistics
                bn = model.get_submodule(name)
                acc = _measure(model, name, data, device, calls[name])
                n = int(acc["n"])
                if n < 2:
                    raise InputError(f"BatchNorm module {name!r} saw {n} value(s) per channel "
                                     "on the data; expected at least 2")
                mean = acc["sum"] / n
                var = (acc["sumsq"] / n - mean * mean).clamp_min(0) * (n / (n - 1))
                require_finite("REPAIR", f"the input statistics of BatchNorm module {name!r}", mean, var)
                old_m, old_v = bn.running_mean.double(), bn.running_var.double()
                std = var.sqrt()
                out.append(BatchNormReset(
                    name, int(mean.numel()), n,
                    (std / old_v.to(std.device).clamp_min(1e-60).sqrt()).mean().item(),
                    ((mean - old_m.to(mean.device)).abs() / std.clamp_min(1e-30)).mean().item()))
                bn.running_mean.copy_(mean.to(bn.running_mean))
                bn.running_var.copy_(var.to(bn.running_var))
    finally:
        for m, training in modes.items():
            m.training = training
    return out


def repair(model, parents, weights, data, report=None, *, sequential: bool = True) -> RepairReport:
    """REPAIR of a merge (``model``, in place), BatchNorm layers included: see the module
    docstring and :func:`~symgraph.merging.repair.renormalize` (same arguments)."""
    t0 = time.perf_counter()
    data = list(data) if data is not None else []
    names = batchnorm_layers(model)
    if not names:
        return renormalize(model, parents, weights, data, report, sequential=sequential)
    if not data:
        raise InputError("REPAIR needs data: a non-empty list of batches to measure activations on")
    first = reset_batchnorm(model, data, names)  # the merge's own collapse, reported
    if report is None:
        from ..report.api import analyze
        report = analyze(model, data[0])
    if find_sites(report):
        rep = renormalize(model, parents, weights, data, report, sequential=sequential)
        reset_batchnorm(model, data, names)  # the corrections moved later BatchNorm inputs
        rep.passes += 2 * len(names)
    else:
        rep = RepairReport([], sequential, len(names))
    rep.batchnorm = first
    rep.seconds = time.perf_counter() - t0
    return rep
