"""The merge engine: checkpoints read tensor by tensor, never a whole model in memory.

Its steps, in :class:`StreamingMerge`:

1. **plan** — the checkpoints are :class:`~symgraph.checkpoints.sharded.Checkpoint` s, checked
   complete from their headers, their model built on the ``meta`` device for the analysis;
2. **align** — every other checkpoint is solved against the anchor by weight matching
   (:func:`symgraph.alignment.driver.align_tensors`) through lazy, norm-folded views
   (:class:`~symgraph.merging.engine.views.Folded`), or by activations: the graphs of the anchor and
   the other model run side by side on the data, op by op, each weight read when an op takes
   it (:class:`~symgraph.alignment.graphrun.Stepper`); with ``refine=N``, learned matching
   from the better of the activation and weight alignments, the model between the two
   differentiated segment by segment (:mod:`.learned`); full groups then fitted from the
   stored tensors (:class:`~.views.Sides`);
3. **statistics** — the merge method's (RegMean's input Grams, Fisher's squared gradients)
   are taken out of core and spilled to disk (:mod:`symgraph.merging.engine.sums`);
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
working copies are sized from one memory budget (:func:`budgets`); :class:`~symgraph.merging.engine.views.Ledger`
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

from ..core.progress import bar as progress_bar
from ..errors import InputError
from ..transform.folding import gauge
from ..checkpoints.sharded import Checkpoint, KeysDiffer, ShardWriter, parse_size
from .methods import registry
from .methods.registry import mixing_weights
from .config import MergeConfig, engine_config, solver_options
from . import repair_stream
from .engine import slicing
from .engine.sinks import Into, write_config
from .engine.sums import MemorySpill, Spill
from .untie import untie_checkpoint, untie_config_updates
from .engine.views import DEFAULT_CACHE, Folded, Sides, return_freed_memory
from .engine import Executor, build_plan
from .engine.executor import Resources, Transforms
from .engine.measuring import RepairContext
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
    architecture; ``config``: the one :class:`~symgraph.merging.config.MergeConfig` (its
    ``models`` and ``out`` are the caller's), or its fields as keyword ``options`` (``align=None``
    for ``"none"``, ``method_options`` for ``parameters``: :func:`~.config.engine_config`), checked
    by the same rules; options the config does not hold (``solver``, ``inner``, ``refine_lr``)
    go to the alignment. ``data``: batches (as for :func:`symgraph.align`), for activation
    matching, the method's statistics (its declared kind, :mod:`.engine.statistics`) and REPAIR;
    ``method``: a method instance the config's ``method`` stands for; ``rows_from``: batches whose
    tokens' embedding rows weight matching reads; ``cache_bytes``: each model's cache without a
    memory budget (:func:`budgets`). The constructor reads headers only; :meth:`align` solves;
    :meth:`write` takes the method's statistics and writes the merged checkpoint into a
    directory (``save_atomic`` passes its temporary one).
    """

    def __init__(self, paths, config: MergeConfig | None = None, *, data=None, progress: bool = False,
                 rows_from=None, method=None, cache_bytes: int = DEFAULT_CACHE, **options):
        paths = list(paths)
        if len(paths) < 2:
            raise InputError(f"merge needs at least 2 checkpoints, got {len(paths)}")
        data = list(data) if data is not None else None
        self.config, align_options = engine_config(paths, config, options, data, method)
        cfg = self.config
        if cfg.refine and cfg.align != "activations":
            raise InputError(f"refine={cfg.refine} starts from activation matching and lowers a loss on the data; "
                             "expected align='activations' with data")
        self.how = registry.get(method if method is not None else cfg.method, **dict(cfg.parameters))
        if self.how.needs_data and not data:  # a method instance the config does not name
            raise InputError(f"method={self.how.name!r} needs data: a list of batches (e.g. dicts with 'input_ids')")
        if data and cfg.align != "activations" and not self.how.needs_data and not cfg.repair:
            raise InputError(f"data is used by align='activations' or a method that takes statistics, got "
                             f"align={cfg.align!r} and method={self.how.name!r}")
        self.repair_report: RepairReport | None = None  # what REPAIR did (repair=True), once written
        self.weights = mixing_weights(cfg.weights, len(paths))
        self.progress, self.data = progress, data
        cache, chunk, stats = budgets(cfg.memory_budget, len(paths), cache_bytes)
        self.resources = Resources(torch.device(cfg.device), torch.device("cpu"), torch.float32, cache, chunk, stats)
        self.stats: list = [None] * len(paths)
        if cfg.refine and {"loss_fn", "between"} & set(align_options):
            raise InputError("out of core, learned matching lowers the model's own loss on the anchor's "
                             "architecture; expected no loss_fn or between (symgraph.align takes them)")
        self.refine_lr = align_options.pop("refine_lr", 1e-3)
        self.align_options = align_options | solver_options(cfg)
        self.rows_from = list(rows_from) if rows_from is not None else None  # batches: read only their tokens' rows
        return_freed_memory()
        self.ckpts = [Checkpoint(os.fspath(p)) if isinstance(p, (str, os.PathLike)) else p for p in paths]  # or ModelCheckpoints
        self.ckpts = [untie_checkpoint(c) for c in self.ckpts] if cfg.untie else self.ckpts  # before the checks
        self._check_family()
        # rotations are solved and applied in float32 for 16- and 32-bit weights (their own
        # precision is far coarser), in float64 for float64 checkpoints
        if any(c.dtype == torch.float64 for c in self.ckpts):
            self.resources.work_dtype = torch.float64
        if len({c.dtype for c in self.ckpts}) > 1:  # stored in different dtypes: every graph (traced on
            for c in self.ckpts:                    # meta) runs in the work dtype, tensors cast up to it
                c.model = c.retyped(self.resources.work_dtype)
        self.alignments: list = [None] * len(paths)
        # the anchor's report (None: not aligned) and the graph the method's statistics run on
        self.report: SymmetryReport | None = None
        self.graph_report: SymmetryReport | None = None  # the anchor's (None: not aligned); the graph statistics run
        self.timings: dict = {}
        self.spill: Spill | MemorySpill | None = None  # the method's statistics while writing
        # what a transform of the plan changes (REPAIR, circuit-space heads, untying): the
        # combine of a group, the shapes written, corrections of merged tensors, the config
        self.transforms = Transforms(self.how.combine_group, untie_config_updates(
            getattr(self.ckpts[self.anchor].source, "config", None)))
        from .circuits import streamed  # imported here: the engine loads nothing of a transform it does not run
        self.transforms.circuits = streamed(cfg, self.ckpts, self.how.name, lambda: self.report)  # None: heads

    # the settings of the one config, as the engine's steps read them
    anchor = property(lambda self: 0 if self.config.anchor == "universe" else self.config.anchor)
    align_mode = property(lambda self: None if self.config.align == "none" else self.config.align)
    fold_norms = property(lambda self: self.config.fold_norms)
    outputs = property(lambda self: self.config.outputs)
    repair = property(lambda self: self.config.repair)
    refine = property(lambda self: self.config.refine)
    memory_budget = property(lambda self: self.config.memory_budget)
    shard_bytes = property(lambda self: parse_size(self.config.max_shard_size) if self.config.max_shard_size
                           else DEFAULT_SHARD)

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
            res = self.resources
            learning = Learning(A, self.data, self.refine, self.refine_lr, res.device, res.ledger, res.stats_bytes,
                                self.memory_budget is not None, res.work_dtype, self.align_options, self.progress)
            check_budget(learning, ra)
        slicing.check_floor(self, budgets)  # the plan's largest piece within the budget, before any alignment
        t1 = time.perf_counter()
        dev = None if self.resources.device.type == "cpu" else self.resources.device
        fa = Folded(ra, A, self.resources.cache_bytes, self.resources.work_dtype, dev, self.resources.ledger)
        gains = gauge(ra.folds, {n: A.get(n).to(self.resources.device) for f in ra.folds for n in (f.gain, f.shift) if n})
        with progress_bar(total=len(self.ckpts) - 1, desc="aligning", unit="model", enabled=self.progress) as bar:
            for i, c in enumerate(self.ckpts):
                if i == self.anchor:
                    continue
                same = {n: tuple(p.shape) for n, p in c.model.named_parameters()} == \
                       {n: tuple(p.shape) for n, p in A.model.named_parameters()}
                rb = ra if same else analyze(c.model, example, fold_norms=self.fold_norms, outputs=self.outputs)
                fb = Folded(rb, c, self.resources.cache_bytes, self.resources.work_dtype, dev, self.resources.ledger)
                acts = {} if self.align_mode != "activations" else dict(
                    data=self.data, models=(A.model, c.model), fetch=(A.fetch, c.fetch), stats_budget=self.resources.stats_bytes,
                    device=dev)
                sides = Sides(A, c, (fa, fb), self.resources.cache_bytes, self.resources.ledger, dev)  # what full groups read
                if self.refine:  # imported here: the engine loads nothing of a step it does not run
                    from .learned import refined
                    self.alignments[i] = refined(learning, c, ra, rb, (fa, fb), gains, sides, acts)
                else:
                    self.alignments[i] = align_tensors(ra, rb, fa, fb, gains, exact_dtype=self.resources.work_dtype,
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
        self.resources.out_device = torch.device(device) if device is not None else self.resources.device
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
            if self.transforms.circuits is not None:  # circuit-space heads: their shapes, config fields, combine
                self.transforms.apply(self.transforms.circuits.widening())
            if self.repair:  # last: it measures the merge as written
                self.repair_report = repair_stream.repair(RepairContext.of(self))
            t1 = time.perf_counter()
            info = write()
            self.timings["write"] = time.perf_counter() - t1
            return info
        finally:
            if self.spill is not None:
                self.spill.close()

    def plan(self):
        """The plan of this merge (:class:`~.engine.plan.Plan`): its tasks in the anchor's key
        order, once the alignment is known."""
        return build_plan(self, self.graph_report, self.transforms.out_shapes)

    def executor(self, plan=None):
        """The :class:`~.engine.executor.Executor` of ``plan`` (default: :meth:`plan`) over this
        merge's alignments, method, statistics, device and ledger."""
        return Executor(plan or self.plan(), alignments=self.alignments, stats=self.stats, weights=self.weights,
                        resources=self.resources, transforms=self.transforms,
                        elementwise_statistics=self.how.elementwise_statistics)

    def _write_into(self, sink: Into) -> dict:
        self.executor().run(sink, self.progress)
        return sink.close()

    def _write(self, directory: str) -> dict:
        A, plan = self.ckpts[self.anchor], self.plan()
        writer = ShardWriter(directory, self.shard_bytes, list(plan.outputs))
        self.executor(plan).run(writer, self.progress)
        info = writer.close()
        write_config(A.path, directory, self.transforms.config_updates)
        for fn in EXTRA_FILES:
            src = os.path.join(A.path, fn)
            if os.path.isfile(src):
                shutil.copy2(src, os.path.join(directory, fn))
        return info

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
