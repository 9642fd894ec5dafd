"""How the merge engine computes a large tensor group in slices
(:class:`~symgraph.merging.streaming.StreamingMerge`): along an axis no map and no fold acts on,
so that the slices are those of the whole computation."""
from __future__ import annotations

import numpy as np
import torch

__all__ = ["split"]


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
    A, R = job.ckpts[job.anchor], job.report
    if R is not None and any(n in R.stacked for n in names):
        return None  # the report's axes are of the viewed (experts × hidden) layout
    if any(n in job.corrections or A.key(n) in job.out_shapes for n in names):
        return None  # a transform's tensors are computed whole
    item = torch.empty((), dtype=job.work_dtype).element_size()
    shapes = {n: A.shapes[A.key(n)] for n in names}
    numel = {n: int(np.prod(shapes[n], dtype=np.int64)) for n in names}
    big = max(names, key=numel.get)
    if sum(numel.values()) * item <= job.chunk_bytes:
        return None
    for d in range(len(shapes[big])):
        dims = {big: d} if R is None else _sliceable(job, names, R.axis_key(R.param_axes(big)[d]))
        if not dims or item * sum(numel[n] for n in names if n not in dims) > job.chunk_bytes:
            continue
        if not all(job.how.sliceable(n, e, job.graph_report) for n, e in dims.items()):
            continue  # a whole remainder this large is recomputed for every slice: not worth it
        row = item * sum(numel[n] // max(shapes[n][e], 1) for n, e in dims.items())
        rows = [n for n, e in dims.items() if e == 0 and len(job.keys_of(n)) == 1]
        first = max(rows, key=numel.get) if rows else None
        order = [n for n in names if n not in dims] + [first] * bool(first)
        order += [n for n in dims if n != first]
        return tuple(order), dims, shapes[big][d], max(1, job.chunk_bytes // max(row, 1)), first
    return None

def _sliceable(job, names, key) -> dict | None:
    """``{name: dim}`` of the tensors of ``names`` with a dim of the anchor's axis class
    ``key``, when the group can be computed in slices along it (see :func:`split`)."""
    A, R = job.ckpts[job.anchor], job.report
    assert R is not None  # _split asks only with a report
    dims: dict[str, int] = {}
    for n in names:
        hits = [d for d, a in enumerate(R.param_axes(n)) if R.axis_key(a) == key]
        if len(hits) > 1:
            return None
        dims.update({n: hits[0]} if hits else {})
    for al, c in zip(job.alignments, job.ckpts):
        if al is None:
            continue
        rb = al.report_b
        for n, d in dims.items():
            if (c.shapes[c.key(n)][d] != A.shapes[A.key(n)][d]
                    or rb.axis_map(rb.param_axes(n)[d], al.elements) is not None):
                return None
        for f in rb.folds:
            if f.gain in dims or f.shift in dims:
                return None
            for w, axis, b in f.readers:
                bias_dim = dims[w] - (dims[w] > axis) if w in dims else None
                if dims.get(w) == axis or (b and dims.get(b) != bias_dim):
                    return None
    return dims
