"""The executor: runs a merge :class:`~.plan.Plan`'s group tasks in order, within the memory
budget, on the device.

For each task every model's tensors are read (the slice the task asks for), put on the device,
carried into the anchor's basis (:func:`~symgraph.transform.apply.move`, in the work dtype where
a map acts), combined by the method's ``combine_group`` in the work dtype (float32, float64 for
float64 checkpoints) with the statistics sliced alike, cast to the anchor checkpoint's dtype for
that tensor, corrected where a step of the plan made a correction (REPAIR), checked finite and
given to a sink (:class:`~symgraph.checkpoints.sharded.ShardWriter` or a model in memory).
Every working copy is counted by the :class:`~symgraph.merging.engine.views.Ledger` while held and
dropped after its last use. The method sees only tensors, never the executor.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ...core.elements import elements_on
from ...core.finite import all_finite
from ...core.progress import bar as progress_bar
from ...errors import InputError
from ...transform.apply import move
from .slicing import keys_of
from .views import Ledger, Sliced, nbytes

__all__ = ["Executor", "Resources", "Transforms"]


@dataclass
class Resources:
    """What a merge computes with and within: the compute ``device``, the ``out_device`` merged
    tensors go to (the CPU for files), the ``work_dtype`` (float32; float64 for float64
    checkpoints), the byte sizes the memory budget gives (each model's cache of folded or moved
    tensors, a group's chunk above which it is computed in slices, a pass of statistics), the
    :class:`~.views.Ledger` of bytes held, whose peak the budget bounds, whether the steps
    show a ``progress`` bar, the memory ``budget`` (bytes; None: none given), the ``exact``
    dtype a piece is carried and combined in where it fits (:meth:`Executor.dtype`) and the
    ``solve_dtype`` the alignment's rotations are solved in (the engine sets it from its
    checkpoints: float64 unless every one is 16-bit, never below the work dtype)."""
    device: torch.device
    out_device: torch.device
    work_dtype: torch.dtype
    cache_bytes: int
    chunk_bytes: int
    stats_bytes: int
    ledger: Ledger = field(default_factory=Ledger)
    progress: bool = False
    budget: int | None = None
    exact: torch.dtype | None = None
    solve_dtype: torch.dtype | None = None


@dataclass
class Transforms:
    """What a transform of the plan changes (REPAIR, circuit-space heads, untying): the
    ``combine`` of a group (``(names, values, stats, weights, report) -> merged``), the
    ``config_updates`` of the output's ``config.json``, the shapes written instead of the
    anchor's (``out_shapes``), ``corrections`` of merged tensors (name -> f(tensor) ->
    corrected) and the circuit-space heads (``circuits``; None: the parents' heads), whose
    ``widening()`` :meth:`apply` takes."""
    combine: Callable
    config_updates: dict
    out_shapes: dict = field(default_factory=dict)
    corrections: dict = field(default_factory=dict)
    circuits: Any = None  # a CircuitHeads (merging.circuits)

    def apply(self, change) -> None:
        """Take a transform's ``out_shapes``, ``config_updates`` and ``combine`` (circuit-space
        heads' :class:`~symgraph.merging.circuits.Widening`)."""
        self.out_shapes.update(change.out_shapes)
        self.config_updates.update(change.config_updates)
        self.combine = change.combine


def check_combined(merged, names, shapes) -> None:
    """Refuse what a group's combine returned unless it holds a tensor for each of ``names``, of
    its given shape (``shapes``; a tensor a transform widens is not in it): a method's slip
    would otherwise be broadcast into the output, or fail later by name."""
    got = merged if isinstance(merged, dict) else {}
    for n in names:
        t = got.get(n)
        if not isinstance(t, torch.Tensor):
            raise InputError(f"the merge method's combine_group returned {type(t).__name__} for {n!r}; expected "
                             "a dict with one tensor per name it is given")
        if n in shapes and tuple(t.shape) != shapes[n]:
            raise InputError(f"the merge method's combine_group returned shape {tuple(t.shape)} for {n!r}; "
                             f"expected {shapes[n]}, the shape of the values it was given")


class Executor:
    """Runs ``plan`` (:class:`~.plan.Plan`): ``alignments`` (one per checkpoint, None for the
    anchor unless a shared universe's basis), ``stats`` (per model a mapping or None), the
    normalised mixing ``weights``, the merge's :class:`Resources` (device, output device, work
    dtype, ledger) and :class:`Transforms` (the combine: the method's or a transform's; the
    corrections REPAIR fills before writing)."""

    def __init__(self, plan, *, alignments, stats, weights, resources: Resources, transforms: Transforms,
                 elementwise_statistics=True):
        self.plan, self.alignments, self.stats = plan, list(alignments), stats
        self.weights = [float(w) for w in weights]
        self.resources, self.transforms = resources, transforms
        self.elementwise = elementwise_statistics
        self.on_device: dict = {}  # alignment index -> its elements moved to the device once

    def run(self, writer, progress: bool = False) -> None:
        """Each task computed in the plan's order and given to ``writer.add(key, tensor)``."""
        A = self.plan.anchor_checkpoint
        with progress_bar(total=len(A.keys), desc="writing", unit="tensor", enabled=progress) as bar:
            for task in self.plan.tasks:
                if task.names is None:
                    pieces = [(task.keys[0], self.anchors_own(task.keys[0]))]
                else:
                    pieces = self.pieces(task.names, task.split)
                for n, v in pieces:
                    for k in keys_of(A, n):
                        writer.add(k, v)
                bar.update(len(task.keys))

    def anchors_own(self, key):
        """The anchor's own tensor ``key`` as written: with its correction, if REPAIR made one
        (a BatchNorm layer's running statistics no class moves, reset on the data)."""
        t = self.plan.anchor_checkpoint.read(key)
        return self.transforms.corrections[key](t) if key in self.transforms.corrections else t

    def pieces(self, names, split):
        """``(name, value)`` of the merged ``names`` in write order: whole, or slice by slice
        (``split``: see :func:`~symgraph.merging.engine.slicing.split`), so that memory holds a few
        slices of a large tensor in the work dtype (others of its group assembled in the
        anchor's dtype), not several whole copies."""
        if split is None:
            yield from self.merged(names).items()
            return
        order, dims, size, step, streamed = split
        A, whole = self.plan.anchor_checkpoint, {}
        for start in range(0, size, step):
            stop = min(start + step, size)
            out = self.merged(names, {n: (d, start, stop) for n, d in dims.items()})
            for n in order:
                if n == streamed or (n not in dims and start == 0):
                    yield n, out[n]
                elif n in dims:
                    if n not in whole:
                        whole[n] = torch.empty(A.shapes[A.key(n)], dtype=out[n].dtype, device=self.resources.out_device)
                    whole[n].narrow(dims[n], start, stop - start).copy_(out[n])
            del out
        yield from whole.items()

    def merged(self, names, parts=None) -> dict:
        """Merged values of ``names`` in the anchor's dtypes; ``parts``: ``{name: (dim, start,
        stop)}``, the slices to compute (the statistics sliced alike). Integer tensors (ids,
        counts) are the anchor's. Inputs are checked finite through the result (NaN and inf
        survive averaging and maps); only a non-finite result makes it look for the input
        that caused it."""
        parts = parts or {}
        values, dtypes, ints, held = self.carried(names, parts)
        A = self.plan.anchor_checkpoint
        full = {n: A.shapes[A.key(n)] for n in parts}
        stats = [None if st is None else Sliced(st, parts, full, self.resources.ledger, self.elementwise) for st in self.stats]
        floats = [n for n in names if n not in ints]
        shapes = {n: tuple(values[self.plan.anchor][n].shape) for n in floats if n not in self.transforms.out_shapes}
        merged = self.transforms.combine(floats, values, stats, self.weights, self.plan.report)
        check_combined(merged, floats, shapes)
        self.resources.ledger.hold(sum(nbytes(v) for v in merged.values()))
        self.resources.ledger.drop(held + sum(nbytes(v) for v in merged.values()) + sum(st.read for st in stats if st))
        del values
        out = {}
        for n in names:
            out[n] = ints.pop(n) if n in ints else self.finished(n, merged.pop(n), dtypes[n], names)
        return out

    def carried(self, names, parts) -> tuple:
        """Each model's tensors of ``names`` (the ``parts`` asked for) read, on the device, in
        the anchor's basis and :meth:`dtype`: ``(values, dtypes, ints, held)``, the anchor's
        dtype of each name, its integer tensors (copied as they are) and the bytes held."""
        n_models, anchor, work = len(self.plan.sources), self.plan.anchor, self.dtype(names, parts)
        dtypes, ints, gains, held = {}, {}, {}, 0
        values: list = [None] * n_models
        for i in [anchor] + [i for i in range(n_models) if i != anchor]:
            c, al = self.plan.sources[i], self.alignments[i]
            vals = {}
            for n in names:
                t = c.get(n, check=False, part=parts.get(n))
                if i == anchor:
                    dtypes[n] = t.dtype
                    if not t.dtype.is_floating_point:
                        ints[n] = t.clone()
                if n not in ints:
                    vals[n] = t.to(self.resources.device)
                    if i == anchor and t.dim() <= 1:
                        gains[n] = vals[n]  # the gauge B's gains are unfolded into
            if al is not None:  # the anchor's own alignment (a shared universe) unfolds into its own gauge
                gauge = al.gauge if i == anchor else gains
                vals = vals | move(al.report_b, self.elements(i), vals, gauge, dtype=work)
            values[i] = own = {n: v.to(work) for n, v in vals.items()}
            size = sum(nbytes(v) for v in own.values())
            held += size
            self.resources.ledger.hold(size)
        return values, dtypes, ints, held

    def dtype(self, names, parts) -> torch.dtype:
        """What the piece ``names`` (``parts``) is carried and combined in: the ``exact`` dtype (a
        universe's means: float64, rounded once) where a copy per model and the result fit in what
        the budget leaves beside all the ledger holds (a parent merge's too), else the work dtype."""
        res, A = self.resources, self.plan.anchor_checkpoint
        shapes = {n: list(A.shapes[A.key(n)]) for n in names}
        for n, (d, start, stop) in parts.items():
            shapes[n][d] = stop - start
        numel = (len(self.plan.sources) + 1) * sum(map(math.prod, shapes.values()))
        if res.exact is None or (res.budget is not None and res.ledger.now + numel * res.exact.itemsize > res.budget):
            return res.work_dtype
        return res.exact

    def finished(self, name, value, dtype, names):
        """A merged tensor cast to the anchor's ``dtype``, on the output device, corrected, and
        checked finite in that dtype (overflow too)."""
        out = value.to(dtype).to(self.resources.out_device)
        if name in self.transforms.corrections:
            out = self.transforms.corrections[name](out)
        if not all_finite(out):
            for c in self.plan.sources:
                for m in names:
                    c.get(m)  # raises naming the checkpoint and the tensor
            raise InputError(f"the merged tensor {name!r} is not finite in {dtype} (the inputs are); "
                             "expected weights whose average stays within the dtype's range")
        return out

    def elements(self, i) -> dict:
        """Alignment ``i``'s elements on the device (moved there once)."""
        if self.resources.device.type == "cpu":
            return self.alignments[i].elements
        if i not in self.on_device:
            self.on_device[i] = elements_on(self.alignments[i].elements, self.resources.device)
        return self.on_device[i]
