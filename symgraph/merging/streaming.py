"""Out-of-core merging: checkpoints read tensor by tensor, never a whole model in memory.

The checkpoints are :class:`~symgraph.checkpoints.sharded.Checkpoint` s: checked complete from their headers,
their model built on the ``meta`` device for the analysis, each tensor read when needed.

:class:`StreamingMerge` analyses the anchor's meta model, aligns every other checkpoint by
weight matching (:func:`symgraph.alignment.driver.align_tensors`) through lazy, norm-folded
views of the tensors (:class:`Folded`, a bounded cache), or by activations: the analysis's
graphs of the anchor and the other model run side by side on the data, op by op, each
weight read from its checkpoint when an op takes it and dropped after
(:class:`~symgraph.alignment.graphrun.Stepper`), so memory holds the live activations and
a few weights. It then writes the merge one tensor
group at a time (a norm fold's gain, shift and readers move together; every other tensor
alone): each model's tensors are moved into the anchor's basis, averaged in float32, cast to
the anchor checkpoint's dtype for that tensor and streamed into the output shards
(:class:`~symgraph.checkpoints.sharded.ShardWriter`). A group with a tensor over :data:`CHUNK_BYTES` is
computed in slices along an axis that no map and no fold acts on (an embedding's and LM
head's vocabulary), bit for bit the whole computation, so that its float32 working copies
never exist whole. Floating-point buffers a class moves (BatchNorm's
running statistics) are moved and averaged like the weights (all floating-point buffers are
averaged without alignment); other buffers are the anchor's. Memory holds a few layers'
tensors, whatever the model's size.

:func:`merge_checkpoints` is the Python entry (``symgraph merge`` uses it for plain averages
aligned by weights, by activations or not at all); Fisher, RegMean, REPAIR and learned
matching still load the models (:func:`symgraph.merge`).
"""
from __future__ import annotations

import os
import shutil
import sys
import time
from collections import OrderedDict
from collections.abc import Mapping

import numpy as np
import torch
from tqdm import tqdm

from ..transform.apply import move
from ..core.finite import all_finite
from ..errors import InputError
from ..transform import folding
from ..transform.folding import gauge, groups, members
from ..checkpoints.sharded import Checkpoint, KeysDiffer, ShardWriter, parse_size
from .methods.registry import mixing_weights

__all__ = ["Checkpoint", "KeysDiffer", "Folded", "StreamingMerge", "parse_size", "DEFAULT_SHARD"]

DEFAULT_SHARD = 2 << 30  # bytes per output shard
DEFAULT_CACHE = 64 << 20  # bytes of folded tensors kept per model while aligning (about a layer of 1.1B's MLP)
CHUNK_BYTES = 64 << 20  # a group's tensors over this (in the work dtype) are merged in slices of it
STATS_BYTES = 256 << 20  # activation statistics are taken in passes of this many bytes, solved as each ends
EXTRA_FILES = ("generation_config.json",)


class Folded(Mapping):
    """Parameter name → tensor of a :class:`Checkpoint` with the report's norm gains folded
    (what the symmetry classes act on), read on demand. A fold's tensors are read and folded
    together; the most recently used values are kept up to ``budget`` bytes."""

    def __init__(self, report, ckpt: Checkpoint, budget: int = DEFAULT_CACHE, dtype=torch.float64):
        self.report, self.ckpt, self.budget, self.dtype = report, ckpt, budget, dtype
        self.folds = {n: f for f in report.folds for n in members(f)}
        self._cache: OrderedDict = OrderedDict()
        self._bytes = 0

    def __getitem__(self, name):
        if name in self._cache:
            self._cache.move_to_end(name)
            return self._cache[name]
        f = self.folds.get(name)
        if f is None:
            v = self.ckpt.get(name)
        else:  # this tensor's part of its fold only: the gain (and shift), its reader, its bias
            f = folding.for_reader(f, name)
            raw = {n: self.ckpt.get(n) for n in members(f)}
            v = folding.fold([f], raw, _fold_dtype(f, raw, self.dtype)).get(name, raw[name]).to(raw[name].dtype)
        self._put(name, v)
        return v

    def _put(self, name, v):
        size = v.numel() * v.element_size()
        if size > self.budget:
            return
        if name in self._cache:
            old = self._cache.pop(name)
            self._bytes -= old.numel() * old.element_size()
        self._cache[name] = v
        self._bytes += size
        while self._bytes > self.budget:
            _, old = self._cache.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()

    def clear(self):
        """Drop the cached values. The alignment's bookkeeping holds this mapping in reference
        cycles, which would keep the cache (up to ``budget``) until Python's cycle collector
        runs: on the 1.1B shape, through the write."""
        self._cache.clear()
        self._bytes = 0

    def __iter__(self):
        return iter(self.report.parameters)

    def __len__(self):
        return len(self.report.parameters)


def _fold_dtype(f, raw, dtype):
    """What a fold computes in: the tensors' own 16-bit dtype when it has no shift and every
    tensor is in that dtype (a gain times a weight is exact in float32 for 16-bit inputs and the
    result is rounded once either way: the same bits, without float32 copies), else ``dtype``."""
    dts = {t.dtype for t in raw.values()}
    if f.shift is None and len(dts) == 1 and next(iter(dts)) in (torch.bfloat16, torch.float16):
        return next(iter(dts))
    return dtype


def _return_freed_memory():
    """Ask glibc to serve allocations from 1 MiB up with their own mappings, returned to the
    system when freed. Its default threshold grows to 32 MiB as blocks are freed, so the
    tensors of a layer come from the heap and its high-water mark stays resident (on a
    TinyLlama-1.1B-shaped pair: 1.7 GB resident after alignment for 34 MB of live tensors).
    Process-wide, like any mallopt; a no-op without glibc."""
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        pass


class StreamingMerge:
    """Analyse, align and write a merge of checkpoints without loading any of them whole.

    ``paths``: two or more ``save_pretrained`` directories (or :class:`Checkpoint` s) of one
    architecture; ``align``: "weights", "activations" (with ``data``, batches as for
    :func:`symgraph.align`) or None; ``weights``: mixing weights (uniform by default). The constructor reads
    headers only; :meth:`align` solves; :meth:`write` writes the merged checkpoint into a
    directory (``save_atomic`` passes its temporary one).
    """

    def __init__(self, paths, *, weights=None, align="weights", anchor: int = 0, fold_norms: bool = True,
                 max_shard_size=DEFAULT_SHARD, progress: bool = False, cache_bytes: int = DEFAULT_CACHE,
                 outputs=None, data=None, rows_from=None, **align_options):
        paths = list(paths)
        if len(paths) < 2:
            raise InputError(f"merge needs at least 2 checkpoints, got {len(paths)}")
        if align not in ("weights", "activations", None, "none"):
            raise InputError(f"align={align!r}; expected 'weights', 'activations' or None")
        data = list(data) if data is not None else None
        if align == "activations" and not data:
            raise InputError("align='activations' needs data: a list of batches (e.g. dicts with 'input_ids')")
        if data and align != "activations":
            raise InputError(f"data is used by align='activations' only, got align={align!r}")
        if not 0 <= anchor < len(paths):
            raise InputError(f"anchor={anchor} is not one of the {len(paths)} checkpoints")
        self.weights = mixing_weights(weights, len(paths))
        self.align_mode = None if align in (None, "none") else align
        self.anchor, self.fold_norms, self.progress = anchor, fold_norms, progress
        self.outputs = outputs  # the outputs the alignment keeps (None: all)
        self.data = data
        self.shard_bytes, self.cache_bytes = parse_size(max_shard_size), cache_bytes
        self.align_options = align_options
        self.rows_from = list(rows_from) if rows_from is not None else None  # batches: read only their tokens' rows
        _return_freed_memory()
        self.ckpts = [p if isinstance(p, Checkpoint) else Checkpoint(p) for p in paths]
        self._check_family()
        # rotations are solved and applied in float32 for 16- and 32-bit weights (their own
        # precision is far coarser), in float64 for float64 checkpoints
        self.work_dtype = torch.float64 if any(c.dtype == torch.float64 for c in self.ckpts) else torch.float32
        if len({c.dtype for c in self.ckpts}) > 1:  # stored in different dtypes: every graph (traced on
            for c in self.ckpts:                    # meta) runs in the work dtype, tensors cast up to it
                c.model = c.model.to(self.work_dtype)
        self.alignments: list = [None] * len(paths)
        self.report = None
        self.timings: dict = {}

    def _check_family(self):
        A = self.ckpts[self.anchor]
        for c in self.ckpts:
            if c.cls is not A.cls:
                raise InputError(f"{A.path!r} is a {A.cls.__name__} but {c.path!r} is a {c.cls.__name__}; "
                                 "expected models of one architecture")
            if self.align_mode is None:
                other = sorted(k for k in A.shapes if c.shapes.get(k) != A.shapes[k])
                if other or set(c.shapes) != set(A.shapes):
                    k = (other or sorted(set(c.shapes) ^ set(A.shapes)))[0]
                    raise InputError(f"{c.path!r} and the anchor {A.path!r} differ in tensor {k!r} "
                                     f"({c.shapes.get(k)} vs {A.shapes.get(k)}); without alignment the "
                                     "checkpoints must have the same tensors and shapes (models of "
                                     "different widths need --align weights)")

    def align(self):
        """Analyse the anchor's meta model and solve every other checkpoint by weights."""
        from ..alignment.driver import align_tensors
        from ..report.api import analyze
        t0 = time.perf_counter()
        A = self.ckpts[self.anchor]
        if self.align_mode is None:  # nothing to move: every tensor is averaged as it is
            return self.alignments
        example = self.data[0] if self.data else None
        ra = analyze(A.model, example, fold_norms=self.fold_norms, outputs=self.outputs)
        self.report = ra
        if self.rows_from:  # weight matching reads only the embedding rows of the tokens in these batches
            self.align_options = {**self.align_options, "rows": ra.input_rows(self.rows_from)}
        self.timings["analyze"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        fa = Folded(ra, A, self.cache_bytes, self.work_dtype)
        gains = gauge(ra.folds, {n: A.get(n) for f in ra.folds for n in (f.gain, f.shift) if n})
        with tqdm(total=len(self.ckpts) - 1, desc="aligning", unit="model", file=sys.stderr,
                  leave=False, disable=not self.progress) as bar:
            for i, c in enumerate(self.ckpts):
                if i == self.anchor:
                    continue
                same = {n: tuple(p.shape) for n, p in c.model.named_parameters()} == \
                       {n: tuple(p.shape) for n, p in A.model.named_parameters()}
                rb = ra if same else analyze(c.model, example, fold_norms=self.fold_norms, outputs=self.outputs)
                fb = Folded(rb, c, self.cache_bytes, self.work_dtype)
                acts = {} if not self.data else dict(data=self.data, models=(A.model, c.model),
                                                     fetch=(A.fetch, c.fetch), stats_budget=STATS_BYTES)
                self.alignments[i] = align_tensors(ra, rb, fa, fb, gains, exact_dtype=self.work_dtype,
                                                   **acts, **self.align_options)
                fb.clear()
                bar.update()
        fa.clear()
        self.timings["align"] = time.perf_counter() - t1
        return self.alignments

    def write(self, directory: str) -> dict:
        """Write the merged checkpoint into ``directory`` (shards, index, config); returns
        ``{"tensors": n, "bytes": total, "shards": k}``."""
        if self.report is None and self.align_mode is not None:
            self.align()
        t0 = time.perf_counter()
        A = self.ckpts[self.anchor]
        unit = groups(self.report.folds) if self.report is not None else {}
        order, seen = [], set()  # (anchor keys, (names merged for them, split) or None: the anchor's)
        for key in A.keys:
            if key in seen:
                continue
            name = A.param_of.get(key)
            if name is None:  # a buffer: averaged (and moved) or the anchor's
                names = (key,) if self._averaged(key) else None
            else:
                names = unit.get(name, (name,))
            split = self._split(names) if names is not None else None
            names = names if split is None else tuple(split[0])  # the order _pieces yields them in
            keys = (key,) if names is None else tuple(k for n in names for k in self._keys(n))
            order.append((keys, None if names is None else (names, split)))
            seen.update(keys)
        writer = ShardWriter(directory, self.shard_bytes,
                              [(k, A.shapes[k], A.dtypes[k]) for keys, _ in order for k in keys])
        with tqdm(total=len(A.keys), desc="writing", unit="tensor", file=sys.stderr, leave=False,
                  disable=not self.progress) as bar:
            for keys, job in order:
                pieces = self._pieces(*job) if job else [(keys[0], A.read(keys[0]))]
                for n, v in pieces:
                    for k in self._keys(n):
                        writer.add(k, v)
                bar.update(len(keys))
        info = writer.close()
        shutil.copy2(os.path.join(A.path, "config.json"), os.path.join(directory, "config.json"))
        for fn in EXTRA_FILES:
            src = os.path.join(A.path, fn)
            if os.path.isfile(src):
                shutil.copy2(src, os.path.join(directory, fn))
        self.timings["write"] = time.perf_counter() - t0
        return info

    def _averaged(self, buffer) -> bool:
        """A floating-point buffer some class moves (or any one, without alignment)."""
        dtype = self.ckpts[self.anchor].dtypes[buffer]
        return (dtype is not None and dtype.is_floating_point
                and (self.align_mode is None or buffer in self.report.buffers))

    def _keys(self, name) -> list:
        """The anchor checkpoint's keys holding parameter (or buffer) ``name``."""
        A = self.ckpts[self.anchor]
        return [k for k in A.params.get(name, (name,)) if k in A.shapes]

    def _split(self, names):
        """How to compute a group whose largest tensor is over ``CHUNK_BYTES`` (in the work
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
        A, R = self.ckpts[self.anchor], self.report
        if R is not None and any(n in R.stacked for n in names):
            return None  # the report's axes are of the viewed (experts × hidden) layout
        item = torch.empty((), dtype=self.work_dtype).element_size()
        shapes = {n: A.shapes[A.key(n)] for n in names}
        numel = {n: int(np.prod(shapes[n], dtype=np.int64)) for n in names}
        big = max(names, key=numel.get)
        if numel[big] * item <= CHUNK_BYTES:
            return None
        for d in range(len(shapes[big])):
            dims = {big: d} if R is None else self._sliceable(names, R.axis_key(R.param_axes(big)[d]))
            if not dims or item * sum(numel[n] for n in names if n not in dims) > CHUNK_BYTES:
                continue  # a whole remainder this large is recomputed for every slice: not worth it
            row = item * sum(numel[n] // max(shapes[n][e], 1) for n, e in dims.items())
            rows = [n for n, e in dims.items() if e == 0 and len(self._keys(n)) == 1]
            first = max(rows, key=numel.get) if rows else None
            order = [n for n in names if n not in dims] + [first] * bool(first)
            order += [n for n in dims if n != first]
            return tuple(order), dims, shapes[big][d], max(1, CHUNK_BYTES // max(row, 1)), first
        return None

    def _sliceable(self, names, key) -> dict | None:
        """``{name: dim}`` of the tensors of ``names`` with a dim of the anchor's axis class
        ``key``, when the group can be computed in slices along it (see :meth:`_split`)."""
        A, R = self.ckpts[self.anchor], self.report
        dims = {}
        for n in names:
            hits = [d for d, a in enumerate(R.param_axes(n)) if R.axis_key(a) == key]
            if len(hits) > 1:
                return None
            dims.update({n: hits[0]} if hits else {})
        for al, c in zip(self.alignments, self.ckpts):
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

    def _pieces(self, names, split):
        """``(name, value)`` of the merged ``names`` in write order: whole, or slice by slice
        (``split``: see :meth:`_split`), so that memory holds a few slices of a large tensor
        in the work dtype (others of its group assembled in the anchor's dtype), not several
        whole copies."""
        if split is None:
            yield from self._merged(names).items()
            return
        order, dims, size, step, streamed = split
        A, whole = self.ckpts[self.anchor], {}
        for start in range(0, size, step):
            stop = min(start + step, size)
            out = self._merged(names, {n: (d, start, stop) for n, d in dims.items()})
            for n in order:
                if n == streamed or (n not in dims and start == 0):
                    yield n, out[n]
                elif n in dims:
                    if n not in whole:
                        whole[n] = torch.empty(A.shapes[A.key(n)], dtype=out[n].dtype)
                    whole[n].narrow(dims[n], start, stop - start).copy_(out[n])
            del out
        yield from whole.items()

    def _merged(self, names, parts=None) -> dict:
        """Merged values of ``names`` in the anchor's dtypes: each model's tensors moved into
        the anchor's basis (in the work dtype where a map acts), averaged in float32 (float64
        for float64 checkpoints); ``parts``: ``{name: (dim, start, stop)}``, the slices to
        compute of those tensors (see :meth:`_split`). The anchor's tensors go first; of them
        only the small ones (norm gains and shifts, the gauge B is unfolded into) are kept
        while the others are read."""
        A, parts = self.ckpts[self.anchor], parts or {}
        # inputs are checked finite through the result (NaN and inf survive averaging and
        # maps); only a non-finite result makes us look for the input that caused it
        acc, dtypes, gains, ints = {}, {}, {}, {}
        for n in names:
            t = A.get(n, check=False, part=parts.get(n))
            dtypes[n] = t.dtype
            if not t.dtype.is_floating_point:  # integers (ids, counts) are never averaged: the anchor's
                ints[n] = t.clone()
                continue
            acc[n] = t.to(torch.promote_types(t.dtype, torch.float32), copy=True).mul_(float(self.weights[self.anchor]))
            if t.dim() <= 1:
                gains[n] = t
            del t
        for i, (c, w) in enumerate(zip(self.ckpts, self.weights)):
            if i == self.anchor:
                continue
            vals = {n: c.get(n, check=False, part=parts.get(n)) for n in names}
            al = self.alignments[i]
            if al is not None:
                vals = vals | move(al.report_b, al.elements, vals, gains, dtype=self.work_dtype)
            for n in names:
                v = vals.pop(n)
                if n in ints:  # the anchor's (a counter such as num_batches_tracked may differ)
                    continue
                acc[n].add_(v, alpha=float(w))  # promoted into float32 as it is read
        out = {}
        for n in names:
            if n in ints:
                out[n] = ints.pop(n)
                continue
            out[n] = acc.pop(n).to(dtypes[n])
            if not all_finite(out[n]):  # checked in the output dtype: overflow too
                for c in self.ckpts:
                    for m in names:
                        c.get(m)  # raises naming the checkpoint and the tensor
                raise InputError(f"the merged tensor {n!r} is not finite in {dtypes[n]} (the inputs "
                                 "are); expected weights whose average stays within the dtype's range")
        return out
