"""REPAIR: the merge engine's last step before writing, which renormalises the merge's hidden
channels and resets its BatchNorm statistics (the math: :mod:`symgraph.merging.repair`, Jordan
et al. 2023) without a model in memory. ``symgraph.merge(..., repair=True)`` and ``symgraph
merge --repair`` both run it; it reads the merge through a :class:`RepairContext`, never the engine.

Measured on the anchor's traced graph run op by op
(:class:`~symgraph.alignment.graphrun.Stepper`), each weight read when an op takes it:

* **targets** — each parent carried into the anchor's basis one unit at a time
  (``RepairContext.parent``); the per-channel moments at every repaired layer, interpolated
  with the mixing weights;
* **the merge, corrected as it runs** — the merged tensors computed by the engine on demand
  (read, carry, combine, cast: ``RepairContext.merged``). All batches run in lockstep and pause
  just before each repaired layer (graph order); the layer is run once with its merged weights
  to measure the merge there, its correction (:func:`~symgraph.merging.repair.correction`) is
  registered with the engine (``RepairContext.correct``), and the runs go on through the
  corrected layer. A layer's ancestors among the repaired layers are all corrected by then, so
  every layer is measured with every earlier correction applied — one pass over the data.
  ``after`` is measured on the corrected layer's output as the runs pass it; ``before`` is the
  merge at the layer with every earlier layer corrected.

BatchNorm layers (the graph's batch-norm ops whose running statistics are buffers) are reset
in the same pass: the runs pause before each, the population mean and unbiased variance of its
input over every batch (:func:`~symgraph.merging.repair.batchnorm_statistics`) become the
merge's running statistics (a correction of those buffers), and the runs go on through it.
Every BatchNorm and repaired layer is thus measured with every one before it final. A
BatchNorm module whose statistics the graph reads other than through a batch-norm op is
refused (:func:`check`): every ``torch.nn`` BatchNorm module and ``F.batch_norm`` trace to one,
and no model of transformers or diffusers subclasses them (``tests/test_engine_repair.py``).

The engine then writes every merged tensor with its correction applied. Memory holds each
batch's live activations at the current layer, a layer's merged weights (the last one read is
kept whatever its size, for the next batch) and the caches.
"""
from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..alignment.checks import batch_inputs, by_shape
from ..alignment.graphrun import Stepper, flatten_for, runnable
from ..errors import InputError, NeedsMemory
from ..transform.folding import groups
from ..core.progress import bar
from .repair import (BatchNormReset, Moments, RepairLayer, RepairReport, batchnorm_layers, batchnorm_statistics,
                     correction, find_sites, layer_errors)
from .engine.views import Aligned, Ledger, TensorCache, nbytes

__all__ = ["RepairContext", "check", "repair", "batchnorm_nodes"]

aten = torch.ops.aten
#: batch-norm ops as exported graphs hold them: the positions of (input, running mean, running var)
BATCHNORM_OPS = {op: (0, 3, 4) for op in (
    aten._native_batch_norm_legit_no_training.default, aten._native_batch_norm_legit.default,
    aten._native_batch_norm_legit_functional.default, aten.native_batch_norm.default, aten.batch_norm.default)}


@dataclass(frozen=True)
class RepairContext:
    """What REPAIR reads of a merge: the anchor's analysis ``graph_report`` (the graph the data
    runs through) and ``model`` (on ``meta``; traced again for batches of other shapes), the
    ``data`` (a list of batches), the mixing ``weights`` (one per model), ``parent(i)``: model
    ``i`` in the anchor's basis (a view with ``fetch(name)`` and ``clear()``), ``merged(names)``:
    the engine's merge of one group of tensors (``{name: tensor}``, registered corrections
    applied), ``units``: the names merged together with a parameter (a norm fold's group),
    ``merged_name(name)``: the name under which the engine merges a graph input (None: it writes
    the anchor's own, ``anchor_fetch(name)``), ``correct(fixes)``: registers ``{name: f(tensor)
    -> corrected}`` with the engine, the compute ``device``, a cache's ``cache_bytes`` and the
    ``ledger`` of bytes held."""
    graph_report: Any
    model: Any
    data: list
    weights: tuple
    parent: Callable
    merged: Callable
    units: dict
    merged_name: Callable
    anchor_fetch: Callable
    correct: Callable
    device: Any
    cache_bytes: int
    ledger: Ledger

    @classmethod
    def of(cls, job) -> RepairContext:
        """The context of the merge engine ``job`` whose alignment and statistics are done."""
        A, ra = job.ckpts[job.anchor], job.graph_report
        known = set(ra.parameters) | {b for b in ra.buffers if job._averaged(b)}
        if job.align_mode is None:  # every floating-point buffer is combined
            known |= {k for k in A.keys if A.param_of.get(k) is None and job._averaged(k)}

        def merged_name(name):  # a tied name: the one the engine merges
            tied = A.params.get(A.param_of.get(A.key(name)), ())
            return name if name in known else next((n for n in tied if n in known), None)

        def parent(i):
            return Aligned(job.ckpts[i], job.alignments[i], A, ra, job.resources.work_dtype, job.resources.cache_bytes, job.resources.ledger)
        return cls(ra, A.model, job.data, tuple(job.weights.tolist()), parent, job._merged,
                   groups(job.report.folds) if job.report is not None else {}, merged_name, A.fetch,
                   job.transforms.corrections.update, job.resources.device, job.resources.cache_bytes, job.resources.ledger)


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


def check(model, report=None, example=None, **analyze_options):
    """Refuse, in one line, a ``model`` with a BatchNorm module whose running statistics its
    traced graph (``report``; None: ``analyze(model, example, **analyze_options)``) reads other
    than through a batch-norm op: REPAIR resets them where the graph normalises with them. A
    module the graph never reads keeps its merged statistics."""
    names = batchnorm_layers(model)
    if not names:
        return
    if report is None:
        from ..report.api import analyze
        report = analyze(model, example, **analyze_options)
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


class _Merged:
    """The merged model's graph tensors, computed by the engine one unit at a time, with the
    corrections registered so far (a unit recomputed or a cached one corrected)."""

    def __init__(self, ctx: RepairContext):
        self.ctx, self.params = ctx, set(ctx.graph_report.parameters)
        self.fixes: dict = {}  # the corrections registered through this view
        self._cache = TensorCache(ctx.cache_bytes, ctx.ledger)

    def fetch(self, name):
        n = self.ctx.merged_name(name)
        if n is None:  # the anchor's own (computed rotary frequencies, counters), or its
            v = self.ctx.anchor_fetch(name)  # BatchNorm statistics no class moves, once reset
            return self.fixes[name](v) if name in self.fixes else v
        v = self._cache.get(n)
        if v is None:
            out = self.ctx.merged(self.ctx.units.get(n, (n,)) if n in self.params else (n,))
            for m, t in out.items():
                self._cache.put(m, t)
            v = out[n]
        return v

    def correct(self, fixes: dict):
        """Register ``{name: f}`` with the engine (which applies them when it computes) and
        apply them to the cached tensors."""
        self.ctx.correct(fixes)
        self.fixes.update(fixes)
        for n, fix in fixes.items():
            v = self._cache.get(n)
            if v is not None:
                self._cache.put(n, fix(v))

    def clear(self):
        self._cache.clear()


class _Runs:
    """Every batch of one traced shape run in lockstep on ``fetch``: ``to(node)`` advances each
    run to just before graph node ``node``, ``at(node)`` runs that node on each (without
    keeping it), ``through(node)`` advances each past it and yields its output."""

    def __init__(self, rep, batches, fetch, device):
        gm = runnable(rep.exported_program.module(), device)
        order = list(gm.graph.nodes)
        self.nodes = {n.name: n for n in order}
        self.pos = {n.name: i for i, n in enumerate(order)}
        self.before = {n.name: order[i - 1].name for i, n in enumerate(order) if i}
        self.runs = []
        for bi, batch in batches:
            args, kwargs = batch_inputs(rep, batch, bi)
            flat = [t.to(device) if isinstance(t, torch.Tensor) else t for t in flatten_for(gm, args, kwargs)]
            self.runs.append((Stepper(gm, fetch), flat))

    def to(self, node):
        for step, flat in self.runs:
            if step.position > self.pos[node]:
                raise NeedsMemory("the layers REPAIR corrects come in another order in a graph traced on "
                                  "another batch shape")
            if step.position < self.pos[node]:
                for _ in step.steps(flat, frozenset(), stop=self.before[node]):
                    pass

    def inputs(self, node, i: int = 0):
        """Each run's value of argument ``i`` of ``node`` (the runs paused just before it)."""
        arg = self.nodes[node].args[i]
        for step, _ in self.runs:
            yield step.live(arg)

    def at(self, node):
        for step, _ in self.runs:
            yield step.run_node(self.nodes[node]).detach()

    def through(self, node):
        for step, flat in self.runs:
            for _, v in step.steps(flat, frozenset({node}), stop=node):
                yield v


def _moments(site, values) -> tuple:
    """``(mean, std, rms)`` per channel of ``values`` at ``site``, over every batch (summed over
    the processes under ``torch.distributed``)."""
    sums = Moments()
    for v in values:
        sums.add(site.weight, v, site.channel_dim)
    sums.all_reduce()
    return sums.stats(site.weight)


def repair(ctx: RepairContext) -> RepairReport:
    """REPAIR the merge of ``ctx``: registers each repaired layer's correction, and each
    BatchNorm layer's reset running statistics, with the engine (``ctx.correct``) and returns
    the :class:`~symgraph.merging.repair.RepairReport`."""
    t0 = time.perf_counter()
    ra = ctx.graph_report
    sites, norms = find_sites(ra), batchnorm_nodes(ra)
    if not sites and not norms:
        warnings.warn("REPAIR found no channel to repair (no linear or conv output feeds an elementwise "
                      "nonlinearity without a normalisation first)", stacklevel=2)
        return RepairReport([], True, 0, time.perf_counter() - t0)
    shapes = _shapes(ctx, sites, norms)
    targets = _targets(ctx, shapes, sites)
    merged = _Merged(ctx)
    fetch = _Last(merged.fetch, ctx.device, ctx.ledger)
    runs = [(_Runs(rep, batches, fetch, ctx.device), here) for rep, here, batches in shapes]
    pos = {n.name: i for i, n in enumerate(ra.exported_program.graph.nodes)}
    events = sorted([(pos[s.node], s) for s in sites] + [(pos[n], mv) for n, mv in norms.items()],
                    key=lambda e: e[0])
    layers, resets = [], []
    for _, ev in bar(events, desc="REPAIR", unit="layer"):
        if isinstance(ev, tuple):
            resets.append(_reset(runs, merged, fetch, *ev))
        else:
            layers.append(_renormalise(runs, merged, fetch, ev, targets[ev.weight]))
    del runs
    fetch.forget()
    merged.clear()
    return RepairReport(layers, True, (len(ctx.weights) if sites else 0) + 1, time.perf_counter() - t0, resets)


def _shapes(ctx: RepairContext, sites, norms) -> list:
    """``(report, its sites by weight and batch norms by running mean, batches)`` per batch shape."""
    ra, out = ctx.graph_report, []
    for (rep,), batches in by_shape((ra,), (ctx.model,), ctx.data):
        here = {s.weight: s for s in (sites if rep is ra else find_sites(rep))}
        here.update({m: n for n, (m, _) in (norms if rep is ra else batchnorm_nodes(rep)).items()})
        if not {s.weight for s in sites} | {m for m, _ in norms.values()} <= set(here):
            raise InputError("data batches of other shapes give the model other layers to repair; expected "
                             "batches of the first batch's shapes")
        out.append((rep, here, batches))
    return out


def _targets(ctx: RepairContext, shapes, sites) -> dict:
    """The parents' interpolated ``(mean, std, rms)`` per repaired layer (by weight)."""
    targets = {s.weight: [0, 0, 0] for s in sites}
    for i, w in enumerate(ctx.weights if sites else ()):
        view = ctx.parent(i)
        fetch = _Last(view.fetch, ctx.device, ctx.ledger)
        runs = [(_Runs(rep, batches, fetch, ctx.device), here) for rep, here, batches in shapes]
        for s in sites:
            got = _moments(s, [v for r, here in runs for v in r.through(here[s.weight].node)])
            targets[s.weight] = [t + w * x for t, x in zip(targets[s.weight], got)]
        fetch.forget()
        view.clear()
    return targets


def _renormalise(runs, merged: _Merged, fetch: _Last, site, target) -> RepairLayer:
    """Measure the merge at ``site`` (the runs paused before it), register its correction
    towards ``target`` and run every batch through the corrected layer."""
    k = site.weight
    for r, here in runs:
        r.to(here[k].node)
    before = _moments(site, [v for r, here in runs for v in r.at(here[k].node)])
    merged.correct(correction(site, before, target))
    fetch.forget()  # the layer's weights are read again, corrected
    after = _moments(site, [v for r, here in runs for v in r.through(here[k].node)])
    kind = "std" if site.bias is not None else "rms"
    (b, mb), (a, ma) = layer_errors(before, target, kind), layer_errors(after, target, kind)
    return RepairLayer(site.weight, site.bias, site.channels, kind, b, a, mb, ma)


def _reset(runs, merged: _Merged, fetch: _Last, mean_name, var_name) -> BatchNormReset:
    """Reset one BatchNorm layer (running statistics ``mean_name``, ``var_name``): its input's
    population mean and unbiased variance over every batch, measured with the runs paused
    before it, become the merge's running statistics."""
    sums, module = Moments(), mean_name.rsplit(".", 1)[0]
    for r, here in runs:
        node = here[mean_name]
        r.to(node)
        for x in r.inputs(node):
            sums.add(mean_name, x, 1)  # channels on dimension 1
    sums.all_reduce()
    mean, var, n = batchnorm_statistics(sums, mean_name, module)
    old_m, old_v = merged.fetch(mean_name).double().cpu(), merged.fetch(var_name).double().cpu()
    mean, var = mean.cpu(), var.cpu()
    std = var.sqrt()
    merged.correct({mean_name: lambda t, v=mean: v.to(t), var_name: lambda t, v=var: v.to(t)})
    fetch.forget()  # the statistics are read again, reset
    return BatchNormReset(module, int(mean.numel()), n,
                          (std / old_v.clamp_min(1e-60).sqrt()).mean().item(),
                          ((mean - old_m).abs() / std.clamp_min(1e-30)).mean().item())
