"""REPAIR as the merge engine's last step before writing (the math: :mod:`.repair`, Jordan et
al. 2023), without a model in memory, for ``symgraph.merge(..., repair=True)`` and ``symgraph
merge --repair`` alike; it reads the :class:`~.engine.measuring.RepairContext`, never the engine.

The anchor's traced graph runs op by op (:func:`~.engine.segments.op_by_op`), each weight read
when an op takes it: first on each parent in the anchor's basis, for the interpolated
per-channel targets; then on the merge as the engine computes it, all batches in lockstep,
pausing before each repaired layer and each batch-norm op whose running statistics are buffers,
in graph order. There a layer's correction (:func:`~.repair.correction`), or a BatchNorm's
reset statistics, is registered with the engine (``RepairContext.merged.correct``) and the runs
go on through the corrected layer: every layer is measured with every earlier one final, in one
pass over the data. A BatchNorm module the graph reads other than through a batch-norm op is
refused (:func:`check`). Memory holds each batch's live activations, a layer's merged weights
and the caches.
"""
from __future__ import annotations

import time
import warnings

import torch

from ..alignment.checks import by_shape
from ..errors import InputError, NeedsMemory
from ..core.progress import bar
from .repair import (BatchNormReset, Moments, RepairLayer, RepairReport, batchnorm_layers, batchnorm_statistics,
                     correction, find_sites, layer_errors)
from .engine.measuring import Merged, RepairContext
from .engine.segments import op_by_op
from .engine.views import Ledger, nbytes

__all__ = ["check", "repair", "batchnorm_nodes"]

aten = torch.ops.aten
#: batch-norm ops as exported graphs hold them: the positions of (input, running mean, running var)
BATCHNORM_OPS = {op: (0, 3, 4) for op in (
    aten._native_batch_norm_legit_no_training.default, aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit_functional.default, aten.native_batch_norm.default, aten.batch_norm.default)}


def batchnorm_nodes(report) -> dict:
    """``{node name: (running-mean buffer, running-var buffer)}`` of the batch-norm ops of the
    graph of ``report`` whose running statistics are buffers (graph order)."""
    ep = report.exported_program
    buffers = dict(ep.graph_signature.inputs_to_buffers)
    out = {}
    for node in ep.graph.nodes:
        if node.op == "call_function" and node.target in BATCHNORM_OPS:
            _, m, v = BATCHNORM_OPS[node.target]
            mean, var = node.args[m], node.args[v]
            if getattr(mean, "name", None) in buffers and getattr(var, "name", None) in buffers:
                out[node.name] = (buffers[mean.name], buffers[var.name])
    return out


def check(model, report):
    """Refuse, in one line, a ``model`` with a BatchNorm module whose running statistics its
    traced graph (``report``, its analysis) reads other than through a batch-norm op: REPAIR
    resets them where the graph normalises with them. A module the graph never reads keeps its
    merged statistics."""
    names = batchnorm_layers(model)
    if not names:
        return
    ep = report.exported_program
    read = {b for n, b in ep.graph_signature.inputs_to_buffers.items()
            if any(x.name == n and x.users for x in ep.graph.nodes if x.op == "placeholder")}
    found = {b for pair in batchnorm_nodes(report).values() for b in pair}
    other = sorted(({f"{n}.{s}" for n in names for s in ("running_mean", "running_var")} & read) - found)
    if other:
        raise InputError(f"REPAIR resets BatchNorm statistics where the graph normalises with them, and it reads "
                         f"{other[0]!r} outside a batch-norm op; expected BatchNorm modules that normalise "
                         "in their own forward (torch.nn.BatchNorm*, F.batch_norm), or no --repair")


class _Last:
    """``fetch`` with the last tensor read kept (whatever its size): the batches run one op
    after another, so each reads it once."""

    def __init__(self, fetch, device, ledger: Ledger):
        self.inner, self.device, self.ledger, self.name, self.value = fetch, device, ledger, None, None

    def __call__(self, name):
        if name != self.name:
            self.forget()
            self.value = self.inner(name).to(self.device)
            self.name = name
            self.ledger.hold(nbytes(self.value))
        return self.value

    def forget(self):
        self.ledger.drop(nbytes(self.value))
        self.name = self.value = None


class _Runs:
    """Every batch run in lockstep on ``fetch``, each on the graph traced for its shape
    (``shapes``: ``(report, {key: node name}, batches, vias)``, a key a repaired layer's weight or a
    BatchNorm's running mean): ``to(key)`` advances each run to just before the node of ``key``,
    ``inputs(key)`` yields each run's input of it, ``at(key)`` runs it on each (without keeping
    it), ``through(key)`` advances each past it and yields its output."""

    def __init__(self, shapes, fetch, device):
        # per batch shape: ({key: node name}, the nodes in order, node name -> position, runs, {key: the node
        # transposing a weight for x @ W.T})
        self.graphs = []
        for rep, here, batches, vias in shapes:
            gm, runs = op_by_op(rep, batches, fetch, device)
            order = list(gm.graph.nodes)
            self.graphs.append((here, order, {n.name: i for i, n in enumerate(order)}, runs, vias))

    def to(self, key):
        for here, order, pos, runs, _ in self.graphs:
            at = pos[here[key]]
            for step, flat in runs:
                if step.position > at:
                    raise NeedsMemory("the layers REPAIR corrects come in another order in a graph traced on "
                                      "another batch shape")
                if step.position < at:
                    for _ in step.steps(flat, frozenset(), stop=order[at - 1].name):
                        pass

    def inputs(self, key):
        for here, order, pos, runs, _ in self.graphs:
            arg = order[pos[here[key]]].args[0]
            for step, _ in runs:
                yield step.live(arg)

    def at(self, key):
        for here, order, pos, runs, _ in self.graphs:
            for step, _ in runs:
                yield step.run_node(order[pos[here[key]]]).detach()

    def through(self, key):
        for here, order, pos, runs, vias in self.graphs:
            via = vias.get(key)
            for step, flat in runs:
                if via is not None and step.position > pos[via]:  # x @ W.T's transposed weight, read again
                    step.rerun(order[pos[via]])
                for _, v in step.steps(flat, frozenset({here[key]}), stop=here[key]):
                    yield v


def repair(ctx: RepairContext) -> RepairReport:
    """REPAIR the merge of ``ctx``: registers each repaired layer's correction, and each
    BatchNorm layer's reset running statistics, with the engine (``ctx.merged.correct``) and
    returns the :class:`~symgraph.merging.repair.RepairReport`."""
    t0 = time.perf_counter()
    ra = ctx.graph_report
    sites, norms = find_sites(ra), batchnorm_nodes(ra)
    if not sites and not norms:
        warnings.warn("REPAIR found no channel to repair (no linear or conv output feeds an elementwise "
                      "nonlinearity without a normalisation first)", stacklevel=2)
        return RepairReport([], True, 0, time.perf_counter() - t0)
    shapes = _shapes(ctx, sites, norms)
    targets = _targets(ctx, shapes, sites)
    fetch = _Last(ctx.merged.fetch, ctx.device, ctx.ledger)
    runs = _Runs(shapes, fetch, ctx.device)
    pos = {n.name: i for i, n in enumerate(ra.exported_program.graph.nodes)}
    events = sorted([(pos[s.node], s) for s in sites] + [(pos[n], mv) for n, mv in norms.items()],
                    key=lambda e: e[0])
    layers, resets = [], []
    for _, ev in bar(events, desc="REPAIR", unit="layer"):
        if isinstance(ev, tuple):
            resets.append(_reset(runs, ctx.merged, fetch, *ev))
        else:
            layers.append(_renormalise(runs, ctx.merged, fetch, ev, targets[ev.weight]))
    del runs
    fetch.forget()
    ctx.merged.clear()
    return RepairReport(layers, True, (len(ctx.weights) if sites else 0) + 1, time.perf_counter() - t0, resets)


def _shapes(ctx: RepairContext, sites, norms) -> list:
    """``(report, {repaired layer's weight or BatchNorm's running mean: its node}, batches, {weight:
    the node transposing it for x @ W.T})`` per batch shape."""
    ra, out = ctx.graph_report, []
    for (rep,), batches in by_shape((ra,), (ctx.model,), ctx.data):
        found = sites if rep is ra else find_sites(rep)
        here = {s.weight: s.node for s in found}
        here.update({m: n for n, (m, _) in (norms if rep is ra else batchnorm_nodes(rep)).items()})
        if not {s.weight for s in sites} | {m for m, _ in norms.values()} <= set(here):
            raise InputError("data batches of other shapes give the model other layers to repair; expected "
                             "batches of the first batch's shapes")
        out.append((rep, here, batches, {s.weight: s.via for s in found if s.via is not None}))
    return out


def _targets(ctx: RepairContext, shapes, sites) -> dict:
    """The parents' interpolated ``(mean, std, rms)`` per repaired layer (by weight)."""
    targets = {s.weight: [0, 0, 0] for s in sites}
    for i, w in enumerate(ctx.weights if sites else ()):
        view = ctx.parent(i)
        fetch = _Last(view.fetch, ctx.device, ctx.ledger)
        runs = _Runs(shapes, fetch, ctx.device)
        for s in sites:
            got = Moments(s.weight, runs.through(s.weight), s.channel_dim).stats()
            targets[s.weight] = [t + w * x for t, x in zip(targets[s.weight], got)]
        fetch.forget()
        view.clear()
    return targets


def _renormalise(runs: _Runs, merged: Merged, fetch: _Last, site, target) -> RepairLayer:
    """Measure the merge at ``site`` (the runs paused before it), register its correction
    towards ``target`` and run every batch through the corrected layer."""
    k, dim = site.weight, site.channel_dim
    runs.to(k)
    before = Moments(k, runs.at(k), dim).stats()
    merged.correct(correction(site, before, target))
    fetch.forget()  # the layer's weights are read again, corrected
    after = Moments(k, runs.through(k), dim).stats()
    kind = "std" if site.bias is not None else "rms"
    (b, mb), (a, ma) = layer_errors(before, target, kind), layer_errors(after, target, kind)
    return RepairLayer(site.weight, site.bias, site.channels, kind, b, a, mb, ma)


def _reset(runs: _Runs, merged: Merged, fetch: _Last, mean_name, var_name) -> BatchNormReset:
    """Reset one BatchNorm layer (running statistics ``mean_name``, ``var_name``): its input's
    population mean and unbiased variance over every batch, measured with the runs paused
    before it, become the merge's running statistics."""
    module = mean_name.rsplit(".", 1)[0]
    runs.to(mean_name)
    mean, var, n = batchnorm_statistics(Moments(mean_name, runs.inputs(mean_name), 1), module)  # channels on dim 1
    old_m, old_v = merged.fetch(mean_name).double().cpu(), merged.fetch(var_name).double().cpu()
    mean, var = mean.cpu(), var.cpu()
    std = var.sqrt()
    merged.correct({mean_name: lambda t, v=mean: v.to(t), var_name: lambda t, v=var: v.to(t)})
    fetch.forget()  # the statistics are read again, reset
    return BatchNormReset(module, int(mean.numel()), n,
                          (std / old_v.clamp_min(1e-60).sqrt()).mean().item(),
                          ((mean - old_m).abs() / std.clamp_min(1e-30)).mean().item())
