"""REPAIR out of core: the merge engine's step that renormalises the merge's hidden channels
(:mod:`symgraph.merging.repair`, Jordan et al. 2023) without a model in memory.

Measured as :func:`~symgraph.merging.repair.renormalize` measures it, on the anchor's traced
graph run op by op (:class:`~symgraph.alignment.graphrun.Stepper`), each weight read when an
op takes it:

* **targets** — each parent carried into the anchor's basis one unit at a time
  (:class:`~symgraph.merging.views.Aligned`); the per-channel moments at every repaired layer,
  interpolated with the mixing weights;
* **the merge, corrected as it runs** — the merged tensors computed by the engine on demand
  (read, carry, combine, cast: ``job._merged``). All batches run in lockstep and pause just
  before each repaired layer (graph order); the layer is run once with its merged weights to
  measure the merge there, its correction (:func:`~symgraph.merging.repair.correction`) is
  registered with the engine (``job.corrections``), and the runs go on through the corrected
  layer. A layer's ancestors among the repaired layers are all corrected by then, and the
  layers of one wave do not depend on each other, so every layer is measured as the
  sequential in-memory REPAIR measures it — one pass over the data instead of one per wave.
  ``after`` is measured on the corrected layer's output as the runs pass it; ``before`` is
  the merge at the layer's own wave (the in-memory report's ``before`` is the uncorrected
  merge everywhere: equal for the first wave).

The engine then writes every merged tensor with its correction applied. Memory holds each
batch's live activations at the current layer, a layer's merged weights (the last one read is
kept whatever its size, for the next batch) and the engine's caches. Models with BatchNorm
layers (whose running statistics REPAIR recomputes by training-mode passes) are loaded.
"""
from __future__ import annotations

import time
import warnings

import torch

from ..alignment.checks import batch_inputs, by_shape
from ..alignment.graphrun import Stepper, flatten_for, meta_constants, on_device
from ..errors import InputError, NeedsMemory
from ..transform.folding import groups
from .batchnorm import batchnorm_layers
from .repair import RepairLayer, RepairReport, _errors, _Moments, correction, find_sites
from .views import Aligned, Ledger, _Cache, nbytes

__all__ = ["check", "repair"]


def check(job):
    """Raise :class:`~symgraph.errors.NeedsMemory` when the anchor's model has BatchNorm layers."""
    if batchnorm_layers(job.ckpts[job.anchor].model):
        raise NeedsMemory("REPAIR recomputes BatchNorm running statistics by training-mode passes "
                          "over the loaded merge")


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

    def __init__(self, job):
        self.job, self.A = job, job.ckpts[job.anchor]
        self.units = groups(job.report.folds) if job.report is not None else {}
        rep = job.graph_report
        self.params = set(rep.parameters)
        self.known = self.params | {b for b in rep.buffers if job._averaged(b)}
        if job.align_mode is None:  # every floating-point buffer is combined
            self.known |= {k for k in self.A.keys if self.A.param_of.get(k) is None and job._averaged(k)}
        self._cache = _Cache(job.cache_bytes, job.ledger)

    def _name(self, name):
        if name in self.known:
            return name
        p = self.A.param_of.get(self.A.key(name))
        return next((n for n in self.A.params.get(p, ()) if n in self.known), name)

    def fetch(self, name):
        n = self._name(name)
        if n not in self.known:
            return self.A.fetch(name)  # the anchor's own (computed rotary frequencies, counters)
        v = self._cache.get(n)
        if v is None:
            out = self.job._merged(self.units.get(n, (n,)) if n in self.params else (n,))
            for m, t in out.items():
                self._cache.put(m, t)
            v = out[n]
        return v

    def correct(self, fixes: dict):
        """Apply ``{name: f}`` to the cached tensors (the engine applies them when it computes)."""
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
        gm = rep.exported_program.module()
        on_device(gm, device)
        lost = meta_constants(gm)
        if lost:
            raise NeedsMemory(f"the traced graph creates tensor constants ({', '.join(lost[:3])}) whose values "
                              "a model traced without weights (on meta) does not hold")
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

    def at(self, node):
        for step, _ in self.runs:
            yield step.run_node(self.nodes[node]).detach()

    def through(self, node):
        for step, flat in self.runs:
            for _, v in step.steps(flat, frozenset({node}), stop=node):
                yield v


def _moments(here, key, values) -> tuple:
    """``(mean, std, rms)`` per channel of the values at ``key``'s site, over every batch
    (summed over the processes under ``torch.distributed``)."""
    site = here[key]
    sink = _Moments({site.node: (key, site.channel_dim)}, last=None)
    for v in values:
        sink[site.node] = v
    sink.all_reduce()
    return sink.stats(key)


def repair(job) -> RepairReport:
    """REPAIR ``job``'s merge (a :class:`~symgraph.merging.streaming.StreamingMerge` whose
    alignment and statistics are done): registers each repaired layer's correction in
    ``job.corrections`` and returns the :class:`~symgraph.merging.repair.RepairReport`."""
    t0 = time.perf_counter()
    A, ra, dev = job.ckpts[job.anchor], job.graph_report, job.device
    sites = find_sites(ra)
    if not sites:
        warnings.warn("REPAIR found no channel to repair (no linear or conv output feeds an elementwise "
                      "nonlinearity without a normalisation first)", stacklevel=2)
        return RepairReport([], True, 0, time.perf_counter() - t0)
    keys = [s.weight for s in sites]
    shapes = []  # (report, its sites by weight, batches) per traced batch shape
    for (rep,), batches in by_shape((ra,), (A.model,), job.data):
        here = {s.weight: s for s in (sites if rep is ra else find_sites(rep))}
        if not set(keys) <= set(here):
            raise InputError("data batches of other shapes give the model other layers to repair; expected "
                             "batches of the first batch's shapes")
        shapes.append((rep, here, batches))
    targets = {k: [0, 0, 0] for k in keys}  # the parents' interpolated (mean, std, rms)
    for i, w in enumerate(job.weights.tolist()):
        view = Aligned(job.ckpts[i], job.alignments[i], A, ra, job.work_dtype, job.cache_bytes, job.ledger)
        fetch = _Last(view.fetch, dev, job.ledger)
        runs = [(_Runs(rep, batches, fetch, dev), here) for rep, here, batches in shapes]
        for k in keys:
            got = _moments(runs[0][1], k, [v for r, here in runs for v in r.through(here[k].node)])
            targets[k] = [t + w * x for t, x in zip(targets[k], got)]
        fetch.forget()
        view.clear()
    merged = _Merged(job)
    fetch = _Last(merged.fetch, dev, job.ledger)
    runs = [(_Runs(rep, batches, fetch, dev), here) for rep, here, batches in shapes]
    layers = []
    for k, s in zip(keys, sites):
        for r, here in runs:
            r.to(here[k].node)
        before = _moments(runs[0][1], k, [v for r, here in runs for v in r.at(here[k].node)])
        fixes = correction(s, before, targets[k])
        job.corrections.update(fixes)
        merged.correct(fixes)
        fetch.forget()  # the layer's weights are read again, corrected
        after = _moments(runs[0][1], k, [v for r, here in runs for v in r.through(here[k].node)])
        kind = "std" if s.bias is not None else "rms"
        (b, mb), (a, ma) = _errors(before, targets[k], kind), _errors(after, targets[k], kind)
        layers.append(RepairLayer(s.weight, s.bias, s.channels, kind, b, a, mb, ma))
    del runs
    fetch.forget()
    merged.clear()
    return RepairReport(layers, True, len(job.ckpts) + 1, time.perf_counter() - t0)
