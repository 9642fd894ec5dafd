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

BatchNorm layers (the graph's batch-norm ops whose running statistics are buffers) are reset
in the same pass (:mod:`~symgraph.merging.batchnorm`): the runs pause before each, the
population mean and unbiased variance of its input over every batch (float64 sums, channels on
dimension 1) become the merge's running statistics (a correction of those buffers), and the
runs go on through it. Every BatchNorm and repaired layer is thus measured with every one
before it final: what the in-memory REPAIR gives when no renormalised channel feeds a
BatchNorm that feeds another (it resets, renormalises and resets again).

The engine then writes every merged tensor with its correction applied. Memory holds each
batch's live activations at the current layer, a layer's merged weights (the last one read is
kept whatever its size, for the next batch) and the engine's caches.
"""
from __future__ import annotations

import time
import warnings

import torch

from ..alignment.checks import batch_inputs, by_shape
from ..alignment.graphrun import Stepper, flatten_for, runnable
from ..errors import InputError, NeedsMemory
from ..transform.folding import groups
from ..core import distributed
from ..core.finite import require_finite
from ..core.progress import bar
from .batchnorm import BatchNormReset, batchnorm_layers
from .repair import RepairLayer, RepairReport, _errors, _Moments, correction, find_sites
from .views import Aligned, Ledger, _Cache, nbytes

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


def check(job):
    """Raise :class:`~symgraph.errors.NeedsMemory` when the anchor's model has a BatchNorm layer
    whose running statistics its graph reads other than through a batch-norm op (the in-memory
    REPAIR resets them from the module's input; a layer the forward never calls keeps its
    statistics, on either path)."""
    A = job.ckpts[job.anchor]
    if not batchnorm_layers(A.model):
        return
    rep = job.graph_report
    if rep is None:
        from ..report.api import analyze
        rep = analyze(A.model, job.data[0] if job.data else None, fold_norms=job.fold_norms, outputs=job.outputs)
    ep = rep.exported_program
    read = {b for n, b in ep.graph_signature.inputs_to_buffers.items()
            if any(x.name == n and x.users for x in ep.graph.nodes if x.op == "placeholder")}
    found = {b for pair in batchnorm_nodes(rep).values() for b in pair}
    want = {f"{n}.{s}" for n in batchnorm_layers(A.model) for s in ("running_mean", "running_var")}
    if (want & read) - found:
        raise NeedsMemory("REPAIR resets the BatchNorm running statistics "
                          f"{sorted((want & read) - found)[0]!r}, which the traced graph reads outside a "
                          "batch-norm op, from the module's input in the loaded merge")


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
        if n not in self.known:  # the anchor's own (computed rotary frequencies, counters), or its
            v = self.A.fetch(name)  # BatchNorm statistics no class moves, once reset
            return self.job.corrections[n](v) if n in self.job.corrections else v
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
    alignment and statistics are done): registers each repaired layer's correction, and each
    BatchNorm layer's reset running statistics, in ``job.corrections`` and returns the
    :class:`~symgraph.merging.repair.RepairReport`."""
    t0 = time.perf_counter()
    A, ra, dev = job.ckpts[job.anchor], job.graph_report, job.device
    sites, norms = find_sites(ra), batchnorm_nodes(ra)
    if not sites and not norms:
        warnings.warn("REPAIR found no channel to repair (no linear or conv output feeds an elementwise "
                      "nonlinearity without a normalisation first)", stacklevel=2)
        return RepairReport([], True, 0, time.perf_counter() - t0)
    keys = [s.weight for s in sites]
    shapes = []  # (report, its sites by weight and batch norms by running mean, batches) per batch shape
    for (rep,), batches in by_shape((ra,), (A.model,), job.data):
        here = {s.weight: s for s in (sites if rep is ra else find_sites(rep))}
        here.update({m: n for n, (m, _) in (norms if rep is ra else batchnorm_nodes(rep)).items()})
        if not set(keys) | {m for m, _ in norms.values()} <= set(here):
            raise InputError("data batches of other shapes give the model other layers to repair; expected "
                             "batches of the first batch's shapes")
        shapes.append((rep, here, batches))
    targets = {k: [0, 0, 0] for k in keys}  # the parents' interpolated (mean, std, rms)
    for i, w in enumerate(job.weights.tolist() if keys else []):
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
    pos = {n.name: i for i, n in enumerate(ra.exported_program.graph.nodes)}
    events = sorted([(pos[s.node], s) for s in sites] + [(pos[n], mv) for n, mv in norms.items()],
                    key=lambda e: e[0])
    layers, resets = [], []
    for _, ev in bar(events, desc="REPAIR", unit="layer"):
        if isinstance(ev, tuple):
            resets.append(_reset(job, runs, merged, fetch, *ev))
            continue
        k, s = ev.weight, ev
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
    out = RepairReport(layers, True, (len(job.ckpts) if keys else 0) + 1, time.perf_counter() - t0)
    out.batchnorm = resets
    return out


def _reset(job, runs, merged, fetch, mean_name, var_name) -> BatchNormReset:
    """Reset one BatchNorm layer (running statistics ``mean_name``, ``var_name``): its input's
    population mean and unbiased variance over every batch, measured with the runs paused
    before it, become the merge's running statistics (as
    :func:`~symgraph.merging.batchnorm.reset_batchnorm` sets them)."""
    acc: dict = {"n": 0, "sum": 0, "sumsq": 0}
    for r, here in runs:
        node = here[mean_name]
        r.to(node)
        for x in r.inputs(node):
            x = x.detach().double().transpose(0, 1).reshape(x.shape[1], -1)
            acc["n"] += x.shape[1]
            acc["sum"] = acc["sum"] + x.sum(1)
            acc["sumsq"] = acc["sumsq"] + (x * x).sum(1)
    acc = distributed.all_reduce_dict(acc)
    n, module = int(acc["n"]), mean_name.rsplit(".", 1)[0]
    if n < 2:
        raise InputError(f"BatchNorm module {module!r} saw {n} value(s) per channel on the data; "
                         "expected at least 2")
    mean: torch.Tensor = acc["sum"] / n
    var: torch.Tensor = (acc["sumsq"] / n - mean * mean).clamp_min(0) * (n / (n - 1))
    require_finite("REPAIR", f"the input statistics of BatchNorm module {module!r}", mean, var)
    old_m, old_v = merged.fetch(mean_name).double().cpu(), merged.fetch(var_name).double().cpu()
    mean, var = mean.cpu(), var.cpu()
    std = var.sqrt()
    fixes = {mean_name: lambda t, v=mean: v.to(t), var_name: lambda t, v=var: v.to(t)}
    job.corrections.update(fixes)
    merged.correct(fixes)
    fetch.forget()  # the statistics are read again, reset
    return BatchNormReset(module, int(mean.numel()), n,
                          (std / old_v.clamp_min(1e-60).sqrt()).mean().item(),
                          ((mean - old_m).abs() / std.clamp_min(1e-30)).mean().item())
