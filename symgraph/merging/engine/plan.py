"""A merge as a plan: the tasks that write the output, each declaring what it reads.

A :class:`GroupTask` writes some of the anchor checkpoint's keys: the parameters merged
together (a norm fold's gain, shift and readers; any other tensor alone), or the anchor's own
tensor (a buffer no class moves), whole or in slices (:func:`.slicing.split`). The
:class:`Plan` holds the tasks in the anchor's key order and the output's layout; the
:class:`~.executor.Executor` runs it. Built by :func:`build_plan` once the alignment is known.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import slicing
from .slicing import keys_of

__all__ = ["GroupTask", "Plan", "build_plan"]


@dataclass(frozen=True)
class GroupTask:
    """Writes the anchor's ``keys``: the merge of ``names`` (None: the anchor's own tensor of
    ``keys[0]``), whole or in slices (``split``, see :func:`~symgraph.merging.engine.slicing.split`)."""
    keys: tuple
    names: tuple | None = None
    split: tuple | None = None


@dataclass(frozen=True)
class Plan:
    """The tasks of one merge: ``sources`` (the checkpoints, ``anchor`` the index of the one
    whose basis, keys and dtypes the output takes), ``tasks`` in write order, ``outputs`` (key,
    shape, dtype) in that order, ``report`` (the anchor's analysis the combine reads; None
    without one)."""
    sources: tuple
    anchor: int
    tasks: tuple
    outputs: tuple
    report: object = None

    @property
    def anchor_checkpoint(self):
        return self.sources[self.anchor]


def build_plan(job, report, out_shapes: dict) -> Plan:
    """The plan of ``job`` (the engine, its alignment known): the tasks in the anchor's key
    order, ``report`` (the anchor's, for the combine) and the shapes a transform writes instead of
    the anchor's (``out_shapes``: circuit-space heads)."""
    A = job.checkpoints[job.anchor]
    tasks = []
    for key, names in slicing.units(job):
        split = slicing.split(job, names) if names is not None else None
        names = names if split is None else tuple(split[0])  # the order the executor yields them in
        keys = (key,) if names is None else tuple(k for n in names for k in keys_of(A, n))
        tasks.append(GroupTask(keys, names, split))
    outputs = tuple((k, out_shapes.get(k, A.shapes[k]), A.dtypes[k]) for t in tasks for k in t.keys)
    return Plan(tuple(job.checkpoints), job.anchor, tuple(tasks), outputs, report)
