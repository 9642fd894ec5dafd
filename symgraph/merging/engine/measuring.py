"""The merge measured as it is written, for a step of the plan that corrects it (REPAIR): the
merged model's tensors computed by the executor one unit at a time with the corrections
registered so far (:class:`Merged`), each parent in the anchor's basis, and the
:class:`RepairContext` the engine builds of them (:meth:`RepairContext.of`): the step reads
its context, never the engine."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .plan import Plan
from .views import Ledger, TensorCache, known_name

__all__ = ["Merged", "RepairContext"]


class Merged:
    """The merged model's graph tensors: ``fetch(name)`` computes a parameter's unit (a norm
    fold's group) by ``executor`` (read, carry, combine, cast, corrected) and keeps it in a cache;
    a graph input the engine does not merge (``known``: the names it merges) is the ``anchor``
    checkpoint's own. ``correct(fixes)`` registers ``{name: f(tensor) -> corrected}`` with the
    executor and applies them to what is cached."""

    def __init__(self, anchor, known: set, units: dict, executor):
        self.anchor, self.known, self.units, self.executor = anchor, known, units, executor
        self.params = set(executor.plan.report.parameters)
        self.fixes: dict = {}  # the corrections registered through this view
        self._cache = TensorCache(executor.resources.cache_bytes, executor.resources.ledger)

    def fetch(self, name):
        n = known_name(self.anchor, name, self.known)  # the name the engine merges it under
        if n is None:  # the anchor's own (computed rotary frequencies, counters), or its
            v = self.anchor.fetch(name)  # BatchNorm statistics no class moves, once reset
            return self.fixes[name](v) if name in self.fixes else v
        v = self._cache.get(n)
        if v is None:
            out = self.executor.merged(self.units.get(n, (n,)) if n in self.params else (n,))
            for m, t in out.items():
                self._cache.put(m, t)
            v = out[n]
        return v

    def correct(self, fixes: dict):
        self.executor.transforms.corrections.update(fixes)
        self.fixes.update(fixes)
        for n, fix in fixes.items():
            v = self._cache.get(n)
            if v is not None:
                self._cache.put(n, fix(v))

    def clear(self):
        self._cache.clear()


@dataclass(frozen=True)
class RepairContext:
    """What REPAIR reads of a merge: the anchor's analysis ``graph_report`` (the graph the data
    runs through) and ``model`` (on ``meta``; traced again for batches of other shapes), the
    ``data`` (a list of batches), the mixing ``weights`` (one per model), ``parent(i)``: model
    ``i`` in the anchor's basis (a view with ``fetch(name)`` and ``clear()``), ``merged``: the
    merge as the engine computes it (:class:`Merged`), the compute ``device``, a cache's
    ``cache_bytes`` and the ``ledger`` of bytes held."""
    graph_report: Any
    model: Any
    data: list
    weights: tuple
    parent: Callable
    merged: Merged
    device: Any
    cache_bytes: int
    ledger: Ledger

    @classmethod
    def of(cls, job) -> RepairContext:
        """The context of the merge engine ``job`` whose alignment and statistics are done."""
        A, ra, res = job.checkpoints[job.anchor], job.graph_report, job.resources
        known = set(ra.parameters) | {b for b in ra.buffers if job.averaged(b)}
        if job.align_mode is None:  # every floating-point buffer is combined
            known |= {k for k in A.keys if A.param_of.get(k) is None and job.averaged(k)}
        units = job.report.fold_groups if job.report is not None else {}
        merged = Merged(A, known, units, job.executor(Plan(tuple(job.checkpoints), job.anchor, (), (), ra)))
        return cls(ra, A.model, job.data, tuple(job.weights.tolist()), job.aligned, merged, res.device,
                   res.cache_bytes, res.ledger)
