"""The merge engine: checkpoints read tensor by tensor, never a whole model in memory.

Its steps, in :class:`StreamingMerge`:

1. **plan** — the checkpoints are :class:`~symgraph.checkpoints.sharded.Checkpoint` s, checked
   complete from their headers, their model built on the ``meta`` device for the analysis;
2. **align** — every other checkpoint is solved against the anchor by weight matching
   (:func:`symgraph.alignment.driver.align_tensors`) through lazy, norm-folded views
   (:class:`~symgraph.merging.views.Folded`), or by activations: the graphs of the anchor and
   the other model run side by side on the data, op by op, each weight read when an op takes
   it (:class:`~symgraph.alignment.graphrun.Stepper`); with ``refine=N``, learned matching
   from the better of the activation and weight alignments, the model between the two
   differentiated segment by segment (:mod:`.learned`); full groups then fitted from the
   stored tensors (:class:`~.views.Sides`);
3. **statistics** — the merge method's (RegMean's input Grams, Fisher's squared gradients)
   are taken out of core and spilled to disk (:mod:`symgraph.merging.statistics`);
4. **read, carry, combine, write** — one tensor group at a time (a norm fold's gain, shift and
   readers together; every other tensor alone), each model's tensors are read, put on the
   device, carried into the anchor's basis, combined by the method
   (:meth:`~symgraph.merging.methods.registry.MergeMethod.combine_group`) in float32 (float64
   for float64 checkpoints), cast to the anchor checkpoint's dtype for that tensor and streamed
   into the output shards (:class:`~symgraph.checkpoints.sharded.ShardWriter`).

A group over the chunk size is computed in slices along an axis that no map and no fold acts
on (an embedding's and LM head's vocabulary), bit for bit the whole computation, so that its
working copies never exist whole. Floating-point buffers a class moves (BatchNorm's running
statistics) are moved and combined like the weights (all floating-point buffers without
alignment); other buffers are the anchor's. The caches, a pass of statistics and a group's
working copies are sized from one memory budget (:func:`budgets`); :class:`~symgraph.merging.views.Ledger`
counts the bytes held.

:func:`~symgraph.app.run.merge_checkpoints` is the Python entry; ``symgraph merge`` runs every
merge of local checkpoints here, learned matching included. REPAIR (BatchNorm resets included) runs
as the last step before writing (:mod:`~symgraph.merging.repair_stream`). Untying reads each checkpoint as its untied model
(:func:`~symgraph.merging.untie.untie_checkpoint`); circuit-space heads widen as they combine (:mod:`.circuits`).
"""
from __future__ import annotations

import os
import shutil
import time
from typing import TYPE_CHECKING

import torch

from ..transform.apply import move
from ..core.finite import all_finite
from ..core.progress import bar as progress_bar
from ..errors import InputError
from ..transform.folding import gauge
from ..checkpoints.sharded import Checkpoint, KeysDiffer, ShardWriter, parse_size
from .methods import registry
from .methods.registry import mixing_weights
from . import repair_stream, slicing
from .sinks import Into, write_config
from .statistics import MemorySpill, Spill
from .untie import untie_checkpoint, untie_config_updates
from .views import DEFAULT_CACHE, Folded, Ledger, Sides, Sliced, elements_on, nbytes, return_freed_memory
from .engine.statistics import StatisticsContext, take

if TYPE_CHECKING:
    from ..report.symmetry import SymmetryReport
    from .repair import RepairReport

__all__ = ["Checkpoint", "KeysDiffer", "Folded", "StreamingMerge", "parse_size", "DEFAULT_SHARD", "budgets"]

DEFAULT_SHARD = 2 << 30  # bytes per output shard
CHUNK_BYTES = 64 << 20  # a group's tensors over this (in the work dtype) are merged in slices of it
STATS_BYTES = 256 << 20  # activation statistics are taken in passes of this many bytes, solved as each ends
EXTRA_FILES = ("generation_config.json",)


def budgets(memory_budget, n_models: int, cache_bytes: int = DEFAULT_CACHE) -> tuple:
    """``(cache, chunk, stats)`` bytes from a memory budget (None: the defaults): each
    model's cache of folded or moved tensors, the size of a group above which it is merged in
    slices (each of the ``n_models`` models' working copies and the result held at once), and a
    pass of statistics (activation cross-moments, RegMean's Grams)."""
    if memory_budget is None:
        return cache_bytes, CHUNK_BYTES, STATS_BYTES
    b = parse_size(memory_budget)
    return b // (4 * n_models), max(1 << 10, b // (4 * (n_models + 2))), b // 2


class StreamingMerge:
    """Analyse, align and write a merge of checkpoints without loading any of them whole.

    ``paths``: two or more ``save_pretrained`` directories (or :class:`Checkpoint` s) of one
    architecture; ``align``: "weights", "activations" (with ``data``, batches as for
    :func:`symgraph.align`) or None; ``weights``: mixing weights (uniform by default);
    ``method``: a registered merge method (``method_options`` to its constructor) whose
    statistics it takes out of core (its declared kind, :mod:`symgraph.merging.engine.statistics`,
    on ``data``); ``device``: where tensors are computed (read from disk on the CPU, written
    back from it); ``memory_budget``: bytes the engine may hold at once (its caches, a pass's
    statistics, a group's working copies; see :func:`budgets`); ``untie``: tied parameters
    get their own tensors first and ``attention`` picks heads or circuits, as in :func:`symgraph.merge`;
    ``refine``: learned matching's steps after activation matching (``refine_lr`` their step
    size; :mod:`.learned`), as ``symgraph.align(..., refine=N)`` takes them. The constructor
    reads headers only; :meth:`align` solves; :meth:`write` takes the method's
    statistics and writes the merged checkpoint into a directory (``save_atomic`` passes its temporary one).
    """

    def __init__(self, paths, *, weights=None, align="weights", anchor: int = 0, fold_norms: bool = True,
                 max_shard_size=DEFAULT_SHARD, progress: bool = False, cache_bytes: int = DEFAULT_CACHE,
                 outputs=None, data=None, rows_from=None, method="average", method_options=None,
                 device="cpu", memory_budget=None, untie=False, attention="heads", repair=False, **align_options):
        paths = list(paths)
        if len(paths) < 2:
            raise InputError(f"merge needs at least 2 checkpoints, got {len(paths)}")
        if align not in ("weights", "activations", None, "none"):
            raise InputError(f"align={align!r}; expected 'weights', 'activations' or None")
        data = list(data) if data is not None else None
        if align == "activations" and not data:
            raise InputError("align='activations' needs data: a list of batches (e.g. dicts with 'input_ids')")
        self.how = registry.get(method, **(method_options or {}))
        if self.how.needs_data and not data:
            raise InputError(f"method={self.how.name!r} needs data: a list of batches (e.g. dicts with 'input_ids')")
        if repair and not data:
            raise InputError("repair=True needs data: a list of batches to measure activations on")
        self.repair = bool(repair)
        self.repair_report: RepairReport | None = None  # what REPAIR did (repair=True), once written
        if data and align != "activations" and not self.how.needs_data and not repair:
            raise InputError(f"data is used by align='activations' or a method that takes statistics, got "
                             f"align={align!r} and method={self.how.name!r}")
        if not 0 <= anchor < len(paths):
            raise InputError(f"anchor={anchor} is not one of the {len(paths)} checkpoints")
        self.weights = mixing_weights(weights, len(paths))
        self.align_mode = None if align in (None, "none") else align
        self.anchor, self.fold_norms, self.progress = anchor, fold_norms, progress
        self.outputs = outputs  # the outputs the alignment keeps (None: all)
        self.data = data
        self.shard_bytes = parse_size(max_shard_size)
        self.device = torch.device(device)
        self.out_device = torch.device("cpu")  # where merged tensors go (written from the CPU; write_into: any)
        self.cache_bytes, self.chunk_bytes, self.stats_bytes = budgets(memory_budget, len(paths), cache_bytes)
        self.memory_budget = memory_budget  # as given (None: the defaults, which learned matching's state may exceed)
        self.ledger = Ledger()  # the bytes of tensors the engine holds (its peak is what the budget bounds)
        self.stats: list = [None] * len(paths)
        self._device_elements: dict = {}  # alignment index -> its elements moved to the device once
        # learned matching (refine=N steps after activation matching, :mod:`.learned`); the rest go to align_tensors
        self.refine, self.refine_lr = align_options.pop("refine", 0), align_options.pop("refine_lr", 1e-3)
        if self.refine and (self.align_mode != "activations" or not data):
            raise InputError(f"refine={self.refine} starts from activation matching and lowers a loss on the data; "
                             "expected align='activations' with data")
        if self.refine and {"loss_fn", "between"} & set(align_options):
            raise InputError("out of core, learned matching lowers the model's own loss on the anchor's "
                             "architecture; expected no loss_fn or between (symgraph.align takes them)")
        self.align_options = align_options
        self.rows_from = list(rows_from) if rows_from is not None else None  # batches: read only their tokens' rows
        return_freed_memory()
        self.ckpts = [Checkpoint(os.fspath(p)) if isinstance(p, (str, os.PathLike)) else p for p in paths]  # or ModelCheckpoints
        self.ckpts = [untie_checkpoint(c) for c in self.ckpts] if untie else self.ckpts  # before the checks
        self._check_family()
        # rotations are solved and applied in float32 for 16- and 32-bit weights (their own
        # precision is far coarser), in float64 for float64 checkpoints
        self.work_dtype = torch.float64 if any(c.dtype == torch.float64 for c in self.ckpts) else torch.float32
        if len({c.dtype for c in self.ckpts}) > 1:  # stored in different dtypes: every graph (traced on
            for c in self.ckpts:                    # meta) runs in the work dtype, tensors cast up to it
                c.model = c.retyped(self.work_dtype)
        self.alignments: list = [None] * len(paths)
        # the anchor's report (None: not aligned) and the graph the method's statistics run on
        self.report: SymmetryReport | None = None
        self.graph_report: SymmetryReport | None = None  # the anchor's (None: not aligned); the graph statistics run
        self.timings: dict = {}
        self.spill: Spill | MemorySpill | None = None  # the method's statistics while writing
        # what a transform of the plan changes (REPAIR, circuit-space heads, untying): the
        # combine of a group, the shapes written, corrections of merged tensors, the config
        self.combine = self.how.combine_group  # (names, values, stats, weights, report) -> merged
        self.out_shapes: dict = {}      # anchor key -> the shape written (default: the anchor's)
        self.corrections: dict = {}     # parameter name -> f(merged tensor in its dtype) -> corrected
        self.config_updates = untie_config_updates(getattr(self.ckpts[anchor].source, "config", None))  # config.json fields
        self.prepare: list = []         # f(job), run after the statistics and before writing
        from .circuits import streamed  # imported here: the engine loads nothing of a transform it does not run
        self.circuits = streamed(self, attention)  # circuit-space heads' hooks, set on this job (None: heads)

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
        example = self.data[0] if self.data else None
        if self.repair:  # a BatchNorm REPAIR cannot reset is refused before any work
            repair_stream.check(A.model, self.graph_report, example, fold_norms=self.fold_norms, outputs=self.outputs)
        if self.align_mode is None:  # nothing to move: every tensor is combined as it is
            if (self.how.needs_data or self.repair) and self.graph_report is None:  # the graph its statistics are taken on
                self.graph_report = analyze(A.model, example, fold_norms=self.fold_norms, outputs=self.outputs)
            slicing.check_floor(self, budgets)  # the plan's largest piece within the budget, before any work
            return self.alignments
        ra = analyze(A.model, example, fold_norms=self.fold_norms, outputs=self.outputs)
        self.report = self.graph_report = ra
        if self.rows_from:  # weight matching reads only the embedding rows of the tokens in these batches
            self.align_options = {**self.align_options, "rows": ra.input_rows(self.rows_from)}
        self.timings["analyze"] = time.perf_counter() - t0
        if self.refine:  # learned matching's room in the budget, refused before any alignment
            from .learned import Learning, check_budget
            learning = Learning(A, self.data, self.refine, self.refine_lr, self.device, self.ledger, self.stats_bytes,
                                self.memory_budget is not None, self.work_dtype, self.align_options, self.progress)
            check_budget(learning, ra)
        slicing.check_floor(self, budgets)  # the plan's largest piece within the budget, before any alignment
        t1 = time.perf_counter()
        dev = None if self.device.type == "cpu" else self.device
        fa = Folded(ra, A, self.cache_bytes, self.work_dtype, dev, self.ledger)
        gains = gauge(ra.folds, {n: A.get(n).to(self.device) for f in ra.folds for n in (f.gain, f.shift) if n})
        with progress_bar(total=len(self.ckpts) - 1, desc="aligning", unit="model", enabled=self.progress) as bar:
            for i, c in enumerate(self.ckpts):
                if i == self.anchor:
                    continue
                same = {n: tuple(p.shape) for n, p in c.model.named_parameters()} == \
                       {n: tuple(p.shape) for n, p in A.model.named_parameters()}
                rb = ra if same else analyze(c.model, example, fold_norms=self.fold_norms, outputs=self.outputs)
                fb = Folded(rb, c, self.cache_bytes, self.work_dtype, dev, self.ledger)
                acts = {} if self.align_mode != "activations" else dict(
                    data=self.data, models=(A.model, c.model), fetch=(A.fetch, c.fetch), stats_budget=self.stats_bytes,
                    device=dev)
                sides = Sides(A, c, (fa, fb), self.cache_bytes, self.ledger, dev)  # what full groups read
                if self.refine:  # imported here: the engine loads nothing of a step it does not run
                    from .learned import refined
                    self.alignments[i] = refined(learning, c, ra, rb, (fa, fb), gains, sides, acts)
                else:
                    self.alignments[i] = align_tensors(ra, rb, fa, fb, gains, exact_dtype=self.work_dtype,
                                                       sides=sides, **acts, **self.align_options)
                fb.clear()
                bar.update()
        fa.clear()
        self.timings["align"] = time.perf_counter() - t1
        return self.alignments

    def use(self, report, alignments):
        """Take the alignment step's result instead of running :meth:`align`: the anchor's
        ``report`` and one :class:`~symgraph.Alignment` (or None) per checkpoint, as
        :func:`symgraph.merge` finds them for models in memory (the anchor's own entry is not
        None only for a shared universe's basis)."""
        if self.repair:
            repair_stream.check(self.ckpts[self.anchor].model, report)
        self.graph_report = report
        self.report = report if self.align_mode is not None else None
        self.alignments = list(alignments)

    def write(self, directory: str) -> dict:
        """Take the method's statistics (spilled to a temporary directory beside ``directory``,
        removed after) and write the merged checkpoint into ``directory`` (shards, index,
        config); returns ``{"tensors": n, "bytes": total, "shards": k}``."""
        return self._finish(lambda: Spill(os.path.dirname(os.path.abspath(directory))),
                            lambda: self._write(directory))

    def write_into(self, add, device=None) -> dict:
        """The merge of models in memory: statistics kept in memory, each merged tensor given to
        ``add(key, tensor)`` (in the anchor's dtype for that key, on ``device``: default the
        job's) as it is computed; returns ``{"tensors": n, "bytes": total, "shards": 0}``."""
        self.out_device = torch.device(device) if device is not None else self.device
        return self._finish(MemorySpill, lambda: self._write_into(Into(add)))

    def _finish(self, make_spill, write) -> dict:
        """Statistics, the plan's transforms and REPAIR, then ``write()``."""
        if self.graph_report is None and (self.align_mode is not None or (self.how.needs_data or self.repair)):
            self.align()
        elif self.align_mode is None:  # unaligned and without statistics: align() did not check the budget
            slicing.check_floor(self, budgets)
        self.spill = None
        if self.how.needs_data:
            t0 = time.perf_counter()
            self.spill = make_spill()
        try:
            if self.spill is not None:
                context = StatisticsContext.of(self)  # what the takers read, not the engine
                self.stats = [take(self.how.statistic, context, i) for i in range(len(self.ckpts))]
                self.timings["statistics"] = time.perf_counter() - t0
            for step in self.prepare:
                step(self)
            if self.repair:  # last: it measures the merge as written
                self.repair_report = repair_stream.repair(repair_stream.RepairContext.of(self))
            t1 = time.perf_counter()
            info = write()
            self.timings["write"] = time.perf_counter() - t1
            return info
        finally:
            if self.spill is not None:
                self.spill.close()

    def _order(self) -> list:
        """``(anchor keys, (names merged for them, split) or None: the anchor's own)`` in the
        anchor's key order: the plan's tensor-group tasks."""
        order: list[tuple] = []
        for key, names in slicing.units(self):
            split = slicing.split(self, names) if names is not None else None
            names = names if split is None else tuple(split[0])  # the order _pieces yields them in
            keys = (key,) if names is None else tuple(k for n in names for k in self.keys_of(n))
            order.append((keys, None if names is None else (names, split)))
        return order

    def _emit(self, order, writer):
        """Each task of ``order`` computed and given to ``writer.add(key, tensor)``."""
        A = self.ckpts[self.anchor]
        with progress_bar(total=len(A.keys), desc="writing", unit="tensor", enabled=self.progress) as bar:
            for keys, job in order:
                pieces = self._pieces(*job) if job else [(keys[0], self._anchors(keys[0]))]
                for n, v in pieces:
                    for k in self.keys_of(n):
                        writer.add(k, v)
                bar.update(len(keys))

    def _write_into(self, sink: Into) -> dict:
        self._emit(self._order(), sink)
        return sink.close()

    def _write(self, directory: str) -> dict:
        A = self.ckpts[self.anchor]
        order = self._order()
        writer = ShardWriter(directory, self.shard_bytes,
                              [(k, self.out_shapes.get(k, A.shapes[k]), A.dtypes[k]) for keys, _ in order for k in keys])
        self._emit(order, writer)
        info = writer.close()
        write_config(A.path, directory, self.config_updates)
        for fn in EXTRA_FILES:
            src = os.path.join(A.path, fn)
            if os.path.isfile(src):
                shutil.copy2(src, os.path.join(directory, fn))
        return info

    def _anchors(self, key):
        """The anchor's own tensor ``key`` as written: with its correction, if REPAIR made one
        (a BatchNorm layer's running statistics no class moves, reset on the data)."""
        t = self.ckpts[self.anchor].read(key)
        return self.corrections[key](t) if key in self.corrections else t

    def _averaged(self, buffer) -> bool:
        """A floating-point buffer some class moves (or any one, without alignment)."""
        dtype = self.ckpts[self.anchor].dtypes[buffer]
        if dtype is None or not dtype.is_floating_point:
            return False
        if self.align_mode is None:
            return True
        assert self.report is not None  # aligned: write() runs align() first
        return buffer in self.report.buffers

    def keys_of(self, name) -> list:
        """The anchor checkpoint's keys holding parameter (or buffer) ``name``."""
        A = self.ckpts[self.anchor]
        return [k for k in A.params.get(name, (name,)) if k in A.shapes]

    def _pieces(self, names, split):
        """``(name, value)`` of the merged ``names`` in write order: whole, or slice by slice
        (``split``: see :func:`~symgraph.merging.slicing.split`), so that memory holds a few slices of a large tensor
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
                        whole[n] = torch.empty(A.shapes[A.key(n)], dtype=out[n].dtype, device=self.out_device)
                    whole[n].narrow(dims[n], start, stop - start).copy_(out[n])
            del out
        yield from whole.items()

    def _merged(self, names, parts=None) -> dict:
        """Merged values of ``names`` in the anchor's dtypes: each model's tensors read, put on
        the device, moved into the anchor's basis (in the work dtype where a map acts) and
        combined by the method in the work dtype (float32, float64 for float64 checkpoints)
        with its statistics; ``parts``: ``{name: (dim, start, stop)}``, the slices to compute of
        those tensors (see :func:`~symgraph.merging.slicing.split`), the statistics sliced alike. Integer tensors (ids,
        counts) are the anchor's."""
        A, parts, dev = self.ckpts[self.anchor], parts or {}, self.device
        # inputs are checked finite through the result (NaN and inf survive averaging and
        # maps); only a non-finite result makes us look for the input that caused it
        dtypes, ints, gains, held = {}, {}, {}, 0
        values: list[dict[str, torch.Tensor] | None] = [None] * len(self.ckpts)
        for i in [self.anchor] + [i for i in range(len(self.ckpts)) if i != self.anchor]:
            c, al = self.ckpts[i], self.alignments[i]
            vals = {}
            for n in names:
                t = c.get(n, check=False, part=parts.get(n))
                if i == self.anchor:
                    dtypes[n] = t.dtype
                    if not t.dtype.is_floating_point:
                        ints[n] = t.clone()
                if n not in ints:
                    vals[n] = t.to(dev)
                    if i == self.anchor and t.dim() <= 1:
                        gains[n] = vals[n]  # the gauge B's gains are unfolded into
            if al is not None:  # the anchor's own alignment (a shared universe) unfolds into its own gauge
                gauge = al.gauge if i == self.anchor else gains
                vals = vals | move(al.report_b, self._elements(i), vals, gauge, dtype=self.work_dtype)
            values[i] = own = {n: v.to(self.work_dtype) for n, v in vals.items()}
            held += sum(nbytes(v) for v in own.values())
            self.ledger.hold(sum(nbytes(v) for v in own.values()))
        full = {n: A.shapes[A.key(n)] for n in parts}
        stats = [None if st is None else Sliced(st, parts, full, self.ledger, self.how.elementwise_statistics)
                 for st in self.stats]
        floats = [n for n in names if n not in ints]
        merged = self.combine(floats, values, stats, self.weights.tolist(), self.graph_report)
        self.ledger.hold(sum(nbytes(v) for v in merged.values()))
        self.ledger.drop(held + sum(nbytes(v) for v in merged.values()) + sum(st.read for st in stats if st))
        del values
        out = {}
        for n in names:
            if n in ints:
                out[n] = ints.pop(n)
                continue
            out[n] = merged.pop(n).to(dtypes[n]).to(self.out_device)
            if n in self.corrections:
                out[n] = self.corrections[n](out[n])
            if not all_finite(out[n]):  # checked in the output dtype: overflow too
                for c in self.ckpts:
                    for m in names:
                        c.get(m)  # raises naming the checkpoint and the tensor
                raise InputError(f"the merged tensor {n!r} is not finite in {dtypes[n]} (the inputs "
                                 "are); expected weights whose average stays within the dtype's range")
        return out

    def _elements(self, i) -> dict:
        """Alignment ``i``'s elements on the device (moved there once)."""
        if self.device.type == "cpu":
            return self.alignments[i].elements
        if i not in self._device_elements:
            self._device_elements[i] = elements_on(self.alignments[i].elements, self.device)
        return self._device_elements[i]

