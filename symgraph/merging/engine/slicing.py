"""How the merge engine computes a large tensor group in slices
(:class:`~symgraph.merging.streaming.StreamingMerge`): along an axis no map and no fold acts on,
so that the slices are those of the whole computation; and the smallest memory budget whose
plan holds its largest piece (:func:`check_floor`), known before any alignment, and what a
budget gives each of the engine's holdings (:func:`budgets`)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from ...checkpoints.outdir import human_bytes as hb
from ...core.elements import Perm
from ...core.groups import PERMUTATION_FAMILY
from ...errors import InputError
from .statistics import StatisticsContext, floor
from .views import DEFAULT_CACHE

__all__ = ["split", "units", "check_floor", "identity_alignment", "budgets", "rounded_up", "keys_of"]

CHUNK_BYTES = 64 << 20  # a group's tensors over this (in the work dtype) are merged in slices of it
STATS_BYTES = 256 << 20  # activation statistics are taken in passes of this many bytes, solved as each ends


def budgets(b: int | None, n_models: int, cache_bytes: int = DEFAULT_CACHE) -> tuple[int, int, int]:
    """``(cache, chunk, stats)`` bytes from a memory budget of ``b`` bytes (None: the defaults): each
    model's cache of folded or moved tensors, the size of a group above which it is merged in
    slices (each of the ``n_models`` models' working copies and the result held at once), and a
    pass of statistics (activation cross-moments, RegMean's Grams)."""
    if b is None:
        return cache_bytes, CHUNK_BYTES, STATS_BYTES
    return b // (4 * n_models), max(1 << 10, b // (4 * (n_models + 2))), b // 2


def keys_of(ckpt, name) -> list:
    """The keys of checkpoint ``ckpt`` holding parameter (or buffer) ``name``."""
    return [k for k in ckpt.params.get(name, (name,)) if k in ckpt.shapes]


def split(job, names):
    """How to compute a group whose tensors are over the engine's chunk size (in the work
    dtype) in slices: ``(order, dims, size, step, streamed)``, slicing each tensor of
    ``dims`` at ``dims[name]`` (one axis class of ``size`` coordinates, ``step`` at a
    time); None to compute it whole. Slices are independent where no map acts along the
    sliced axis (for every alignment), no fold scales along it or has its gain or shift
    sliced, and each reader's bias is sliced with its weight (the shift's contraction runs
    along the fold axis): every other step acts along other axes or element-wise, so the
    slices are those of the whole computation (element-wise steps and permutations
    exactly; a dense map is a matrix product whose rows MKL gives bit for bit for slices of
    thousands of rows, as on the 1.1B shape, but not for every slice size). ``order``: the
    unsliced tensors (taken from the first slice), then ``streamed`` (or None), written
    slice by slice as it comes (the largest tensor sliced along dim 0 under one checkpoint
    key), then the others (assembled)."""
    return _choose(job, names, _axes(job, names, job.alignments), job.resources.chunk_bytes)


def _axes(job, names, alignments):
    """What :func:`split` decides from the report, the alignments' classes and the method,
    whatever the chunk size: ``(shapes, numel, item, [(d, dims), ...])``, the axes ``d`` of the
    largest tensor along which the group may be sliced (``dims``: see :func:`split`), or None
    when the group is computed whole at any size."""
    A, R = job.checkpoints[job.anchor], job.report
    if R is not None and any(n in R.stacked for n in names):
        return None  # the report's axes are of the viewed (experts × hidden) layout
    if any(n in job.transforms.corrections or A.key(n) in job.transforms.out_shapes for n in names):
        return None  # a transform's tensors are computed whole
    item = torch.empty((), dtype=job.resources.work_dtype).element_size()
    shapes = {n: A.shapes[A.key(n)] for n in names}
    numel = {n: int(np.prod(shapes[n], dtype=np.int64)) for n in names}
    big = max(names, key=numel.get)
    ways = []
    for d in range(len(shapes[big])):
        dims = {big: d} if R is None else _sliceable(job, names, R.axis_key(R.param_axes(big)[d]), alignments)
        if dims and all(job.how.sliceable(n, e, job.graph_report) for n, e in dims.items()):
            ways.append((d, dims))
    return shapes, numel, item, ways


def _choose(job, names, axes, chunk: int):
    """:func:`split`'s answer for a chunk size of ``chunk`` bytes, from :func:`_axes`."""
    if axes is None:
        return None
    shapes, numel, item, ways = axes
    big = max(names, key=numel.get)
    if sum(numel.values()) * item <= chunk:
        return None
    for d, dims in ways:
        if item * sum(numel[n] for n in names if n not in dims) > chunk:
            continue  # a whole remainder this large is recomputed for every slice: not worth it
        row = item * sum(numel[n] // max(shapes[n][e], 1) for n, e in dims.items())
        rows = [n for n, e in dims.items() if e == 0 and len(keys_of(job.checkpoints[job.anchor], n)) == 1]
        first = max(rows, key=numel.get) if rows else None
        order = [n for n in names if n not in dims] + [first] * bool(first)
        order += [n for n in dims if n != first]
        return tuple(order), dims, shapes[big][d], max(1, chunk // max(row, 1)), first
    return None


def _sliceable(job, names, key, alignments) -> dict | None:
    """``{name: dim}`` of the tensors of ``names`` with a dim of the anchor's axis class
    ``key``, when the group can be computed in slices along it (see :func:`split`)."""
    A, R = job.checkpoints[job.anchor], job.report
    assert R is not None  # _split asks only with a report
    dims: dict[str, int] = {}
    for n in names:
        hits = [d for d, a in enumerate(R.param_axes(n)) if R.axis_key(a) == key]
        if len(hits) > 1:
            return None
        dims.update({n: hits[0]} if hits else {})
    for al, c in zip(alignments, job.checkpoints):
        if al is None:
            continue
        rb = al.report_b
        for n, d in dims.items():  # a map acts along the axis: an element of one of its leaf classes' groups
            if (c.shapes[c.key(n)][d] != A.shapes[A.key(n)][d]
                    or any(g in al.elements for g in rb.axis_groups(rb.param_axes(n)[d]))):
                return None
        for f in rb.folds:
            if f.gain in dims or f.shift in dims:
                return None
            for w, axis, b in f.readers:
                bias_dim = dims[w] - (dims[w] > axis) if w in dims else None
                if dims.get(w) == axis or (b and dims.get(b) != bias_dim):
                    return None
    return dims


def units(job):
    """The plan's tensor-group tasks in the anchor's key order: ``(key, names)``, the names
    merged together for the anchor's ``key`` (a norm fold's gain, shift and readers; any other
    tensor alone), or None for a buffer written as the anchor's own."""
    A = job.checkpoints[job.anchor]
    unit = job.report.fold_groups if job.report is not None else {}
    seen: set[str] = set()
    for key in A.keys:
        if key in seen:
            continue
        name = A.param_of.get(key)
        if name is None:  # a buffer: averaged (and moved) or the anchor's
            names = (key,) if job.averaged(key) else None
        else:
            names = unit.get(name, (name,))
        seen.update((key,) if names is None else (k for n in names for k in keys_of(A, n)))
        yield key, names


def identity_alignment(report) -> SimpleNamespace:
    """The anchor aligned to itself, as the checks before any alignment read an alignment
    (:func:`check_floor`, learned matching's room): ``report`` on both sides, no gauge, and an
    identity element of each group of the form a solved one takes (an index vector for an
    unfibred permutation group, else ``[blocks,] n × n`` matrices): where a map acts and how
    large an element is do not depend on the element's values."""
    eye = {g.id: Perm(torch.arange(g.dim)) if g.blocks == 1 and g.kind in PERMUTATION_FAMILY else
           torch.eye(g.dim, dtype=torch.float64).expand(*([g.blocks] if g.blocks > 1 else []), g.dim, g.dim)
           for g in report.groups}
    return SimpleNamespace(report_a=report, report_b=report, gauge=None, elements=eye)


def check_floor(job, eye) -> None:
    """Refuse the memory budget (``job.resources.budget``) before any alignment when the plan's largest piece holds
    more than it: each group's working copies (one per model and the result, in the work dtype)
    and the statistics its combine reads (:meth:`~.methods.registry.MergeMethod.held_bytes`),
    for the group whole or its largest slice (:func:`split` with ``eye``, the anchor's
    :func:`identity_alignment`, None unaligned: a solved alignment has an element for every
    group, so it slices the same axes; the anchor's report stands for a model of other widths,
    whose mismatched axes are never sliced); or below the floor of the method's statistics
    (:func:`~.engine.statistics.floor` of its kind). The message names what needs it and the
    smallest budget that works (the chunk size :func:`budgets` gives it), rounded up to three digits."""
    budget = job.resources.budget
    if budget is None:
        return
    alignments = [None if i == job.anchor else eye for i in range(len(job.checkpoints))]
    plan = [(names, _axes(job, names, alignments)) for _, names in units(job) if names is not None]
    stats, whose = floor(job.how.statistic, StatisticsContext.of(job))
    need, names, sliced = _need(job, plan, job.resources.chunk_bytes, job.resources.cache_bytes)
    if max(need, stats) <= budget:
        return
    least = hb(_least(job, plan, budget, stats))
    if stats > need:
        raise InputError(f"--memory-budget {hb(budget)} is below what {job.how.name}'s statistics need: "
                         f"{hb(rounded_up(stats))} for {whose}; expected --memory-budget of at least {least} "
                         "(the smallest that works)")
    what = f"{names[0]!r}" + (f" and the {len(names) - 1} tensors merged with it" if len(names) > 1 else "")
    raise InputError(f"--memory-budget {hb(budget)} is below what this merge holds at once: {hb(rounded_up(need))} "
                     f"for {what}{' (its largest slice)' if sliced else ' (held whole)'}, a copy per model and the "
                     f"result{' with the statistics read for it' if job.how.needs_data else ''}"
                     f"{', and the cache of REPAIR' if job.config.repair else ''}; expected "
                     f"--memory-budget of at least {least} (the smallest that works)")


def rounded_up(b: int) -> int:
    """``b`` rounded up to three significant digits (what a size shown says)."""
    unit = 10 ** max(len(str(b)) - 3, 0)
    return -(-b // unit) * unit


def _least(job, plan, budget: int, stats: int = 0) -> int:
    """The smallest budget above ``budget`` with three significant digits (what the message
    shows) whose chunk size gives a plan that fits in it, and at least ``stats`` (the method's
    statistics' floor): found within 1%, then digit by digit."""
    def fits(b):
        cache, chunk, _ = budgets(b, len(job.checkpoints))
        return b >= stats and _need(job, plan, chunk, cache)[0] <= b

    b = max(budget, stats - 1)
    while not fits(rounded_up(b)):
        b = max(b + 1, int(b * 1.01))
    b, top = rounded_up(max(budget + 1, int(b / 1.01))), rounded_up(b)
    while b < top and not fits(b):
        b = rounded_up(b + 1)
    return b


def _need(job, plan, chunk: int, cache: int) -> tuple:
    """``(bytes, names, sliced)`` of the plan's piece that holds most at chunk size ``chunk``: the
    ledger's count while :meth:`~symgraph.merging.engine.executor.Executor.merged` computes it
    (with REPAIR, which computes each piece as it measures the merge, its cache of ``cache`` bytes
    of merged values besides)."""
    A, n, best = job.checkpoints[job.anchor], len(job.checkpoints), (0, (), False)
    item = torch.empty((), dtype=job.resources.work_dtype).element_size()
    for names, axes in plan:
        s = _choose(job, names, axes, chunk)
        held = 0
        for m in names:
            dtype = A.dtypes.get(A.key(m))
            if dtype is not None and not dtype.is_floating_point:
                continue  # integer tensors are the anchor's, never held
            shape = list(A.shapes[A.key(m)])
            if s is not None and m in s[1]:
                shape[s[1][m]] = min(s[3], s[2])
            held += job.how.held_bytes(m, tuple(shape), item, n, job.graph_report)
        best = max(best, (held + cache * job.config.repair, names, s is not None), key=lambda t: t[0])
    return best
