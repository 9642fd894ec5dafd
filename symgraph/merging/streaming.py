"""The merge engine: checkpoints read tensor by tensor, never a whole model in memory.

:class:`StreamingMerge` holds a merge's state from one config (the checkpoints' headers read,
their models built on ``meta``) and runs its steps (:mod:`.engine.steps`): analyse, refuse, **align**
every other checkpoint to the anchor through lazy, norm-folded views
(:class:`~symgraph.merging.engine.views.Folded`: weight, activation or learned matching), take
the method's **statistics**, widen, **REPAIR**, then **write**: the plan of group tasks
(:mod:`.engine.plan`) run by its executor (:mod:`.engine.executor`) within one memory budget,
every byte held counted by the :class:`~.engine.views.Ledger`. ``symgraph merge`` and
:func:`symgraph.merge` (models in memory) run every merge through it.
"""
from __future__ import annotations

import copy
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from ..core.finite import batch_list
from ..errors import InputError
from ..transform.folding import gauge
from ..checkpoints.inputs import DEFAULT_SHARD
from ..checkpoints.sharded import Checkpoint, CheckpointWriter, KeysDiffer, check_pair, parse_size
from .methods import registry
from .methods.registry import mixing_weights
from .config import MergeConfig, engine_config, solver_options
from . import repair_stream
from .engine import steps
from .engine.slicing import budgets
from .engine.sinks import Into
from .engine.sums import MemorySpill, Spill
from ..core.ties import check_untie, untie_config_updates
from ..checkpoints.specs import check_same_configs, with_config_diff
from .engine.views import DEFAULT_CACHE, Aligned, Folded, Sides, fit_dtype, return_freed_memory
from .engine import Executor, build_plan
from .engine.executor import Resources, Transforms

if TYPE_CHECKING:
    from ..report.symmetry import SymmetryReport

__all__ = ["Checkpoint", "KeysDiffer", "Folded", "StreamingMerge", "parse_size", "DEFAULT_SHARD", "budgets"]

# align_options the engine resolves itself, not the solver's: the seen rows' batches, learned matching's rate,
# the analysis's inputs, a shared universe's options and where temporary files go (None: memory)
ENGINE_ONLY = ("rows_from", "refine_lr", "inputs", "universe", "scratch")


@dataclass
class Taken:
    """The method's statistics: per model what was taken (None: nothing), and the ``spill``
    holding them while the merge writes."""
    per_model: list
    spill: Spill | MemorySpill | None = None
    ready: bool = False  # the steps before writing ran (:meth:`StreamingMerge.prepare`)


class StreamingMerge:
    """Analyse, align and write a merge of checkpoints without loading any of them whole.

    ``paths``: two or more ``save_pretrained`` directories (or :class:`Checkpoint` s) of one
    architecture; ``config``: the one :class:`~symgraph.merging.config.MergeConfig` (its
    ``models`` and ``out`` are the caller's), or its fields as keyword ``options`` (``align=None``
    for ``"none"``, ``method_options`` for ``parameters``: :func:`~.config.engine_config`), checked
    by the same rules; options the config does not hold (``solver``, ``inner``, ``refine_lr``;
    ``universe``: a shared universe's ``max_rounds`` and ``tol``; ``scratch``: the directory its
    means and the statistics' spill go to, None: memory) go to the alignment. ``data``: batches (as for :func:`symgraph.align`), for activation
    matching, the method's statistics (its declared kind, :mod:`.engine.statistics`) and REPAIR;
    ``method``: a method instance the config's ``method`` stands for; ``rows_from``: batches whose
    tokens' embedding rows weight matching reads; ``cache_bytes``: each model's cache without a
    memory budget (:func:`~.engine.slicing.budgets`); ``work_dtype``: what rotations are applied and graphs run in
    (default float32, float64 for float64 checkpoints; rotations are solved in float64 unless
    every checkpoint is 16-bit); ``ledger``: another engine's
    :class:`~.engine.views.Ledger` this one's bytes count in. The constructor reads headers only.

    The public surface (what code outside the engine reads; every other attribute is the
    engine's own): ``config``, :attr:`checkpoints`, :attr:`anchor`, ``progress``; the results
    ``alignments`` (one per checkpoint, None for the anchor), :attr:`report` (the anchor's; None
    unaligned), ``weights`` (the mixing weights, normalised), ``timings``, :attr:`universe` and, once prepared,
    :attr:`repair_report`; the steps :meth:`align` (or
    :meth:`use`), :meth:`prepare` (the method's statistics, REPAIR) and :meth:`close`,
    :meth:`write` / :meth:`write_into` / :meth:`merged_model` (the merged tensors), :meth:`plan`,
    :meth:`executor`; and what other steps
    build on: :meth:`output_model`, :meth:`aligned`, :meth:`aligning_to`, :meth:`read`, :meth:`averaging`,
    :meth:`averaged`.
    """

    def __init__(self, paths, config: MergeConfig | None = None, *, data=None, progress: bool = False,
                 rows_from=None, method=None, cache_bytes: int = DEFAULT_CACHE, work_dtype=None, ledger=None,
                 **options):
        paths = list(paths)
        if len(paths) < 2:
            raise InputError(f"merge needs at least 2 checkpoints, got {len(paths)}")
        data = list(data) if data is not None else None
        self.config, align_options = engine_config(paths, config, options, data, method)
        cfg = self.config
        self.how = registry.get(method if method is not None else cfg.method, **dict(cfg.parameters))
        if self.how.needs_data and not data:  # a method instance the config does not name
            raise InputError(f"method={self.how.name!r} needs data: a list of batches (e.g. dicts with 'input_ids')")
        if data and not (cfg.takes_statistics or self.how.needs_data):
            raise InputError(f"data is used by align='activations' or a method that takes statistics, got "
                             f"align={cfg.align!r} and method={self.how.name!r}")
        if cfg.refine and {"loss_fn", "between"} & set(align_options):
            raise InputError("out of core, learned matching lowers the model's own loss on the anchor's "
                             "architecture; expected no loss_fn or between (symgraph.align takes them)")
        self.data = data
        self.reports: dict = {"repair": None, "universe": None}  # what REPAIR and a shared universe did
        rows = {} if rows_from is None else {"rows_from": list(rows_from)}  # batches: read only their tokens' rows
        self.align_options = align_options | solver_options(cfg) | rows
        budget = cfg.budget_bytes
        self.resources = Resources(torch.device(cfg.device), torch.device("cpu"), torch.float32,
                                   *budgets(budget, len(paths), cache_bytes), progress=progress, budget=budget)
        self.resources.ledger = ledger if ledger is not None else self.resources.ledger
        return_freed_memory()
        ckpts = [Checkpoint(os.fspath(p)) if isinstance(p, (str, os.PathLike)) else p for p in paths]  # or in memory
        batch_list(data, *ckpts)  # token ids in every model's vocabulary, before any model runs
        check_same_configs([c.config for c in ckpts], cfg.models, untie=cfg.untie)  # before any tensor is read
        if cfg.untie:
            check_untie([c.model for c in ckpts], cfg.models)
        self._checkpoints = tuple(c.untied() for c in ckpts) if cfg.untie else tuple(ckpts)  # then checked
        self._check_family()
        if cfg.anchor == "universe":  # its rounds' options refused before any work
            from .universe import universe_options
            self.align_options["universe"] = universe_options(self.align_options.get("universe"))
        self.weights  # computed once, refused here before any tensor is read
        # rotations are applied in float32 for 16- and 32-bit weights (their own precision is
        # far coarser), in float64 for float64 checkpoints; the graphs run alike
        wide = any(c.dtype == torch.float64 for c in self._checkpoints)
        self.resources.work_dtype = torch.float64 if wide else torch.float32
        for c in self._checkpoints:
            self.read(c)
        self.resources.work_dtype = work_dtype or self.resources.work_dtype
        # the alignment solves its rotations in float64 (float32 where every checkpoint is
        # 16-bit, whose values hold 8-11 bits): its similarities are small, and in memory or out
        # of core a merge finds the same maps as symgraph.align
        self.resources.solve_dtype = torch.promote_types(self.resources.work_dtype, fit_dtype(*self._checkpoints))
        self.alignments: list = [None] * len(paths)
        self.graph_report: SymmetryReport | None = None  # the anchor's (None: not analysed), statistics' graph too
        self.timings: dict = {}
        self.statistics = Taken([None] * len(paths))
        self.transforms = Transforms(self.how.combine_group, untie_config_updates(
            getattr(self._checkpoints[self.anchor].source, "config", None)))
        if cfg.attention == "circuits":  # imported here: the engine loads nothing of a transform it does not run
            from .circuits import CircuitHeads
            self.transforms.circuits = CircuitHeads(cfg, self._checkpoints, self.how.name, lambda: self.graph_report)

    checkpoints = property(lambda self: self._checkpoints, doc="the checkpoints, as read (untied if asked)")
    anchor = property(lambda self: 0 if self.config.anchor == "universe" else self.config.anchor)
    report = property(lambda self: self.graph_report if self.align_mode is not None else None,
                      doc="the anchor's report (None: not aligned)")
    progress = property(lambda self: self.resources.progress)
    repair_report = property(lambda self: self.reports["repair"], lambda self, v: self.reports.update(repair=v),
                             doc="what REPAIR did (repair=True; a RepairReport), once prepared")
    universe = property(lambda self: self.reports["universe"], lambda self, v: self.reports.update(universe=v),
                        doc="a shared universe's rounds (anchor='universe'), once aligned")
    # the settings of the one config, as the engine's steps read them
    align_mode = property(lambda self: None if self.config.align == "none" else self.config.align)
    weights = cached_property(lambda self: mixing_weights(self.config.weights, len(self._checkpoints)))
    spill = property(lambda self: self.statistics.spill, lambda self, v: setattr(self.statistics, "spill", v))

    def _check_family(self):
        A = self._checkpoints[self.anchor]
        try:
            for c in self._checkpoints:
                check_pair(A, c, A.path, c.path, None if self.align_mode else "without alignment the checkpoints "
                           "must have the same tensors and shapes (models of different widths need --align weights)")
        except InputError as e:
            raise with_config_diff(e, self._checkpoints, self.config.models) from None

    def read(self, ckpt):
        """``ckpt`` (a directory or a :class:`Checkpoint`, e.g. a universe's mean) read as this
        merge reads its own: its graph (traced on meta) run in the work dtype when the
        checkpoints' dtypes differ, their tensors cast up to it."""
        c = Checkpoint(ckpt) if isinstance(ckpt, str) else ckpt
        if len({x.dtype for x in self._checkpoints}) > 1:
            c.model = c.retyped(self.resources.work_dtype)
        return c

    def analyzed(self, c):
        """Checkpoint ``c``'s meta model analysed with the config's folding and outputs (the
        inputs: ``symgraph.merge``'s for models in memory, else the first batch, if any)."""
        from ..report.api import analyze
        cfg, inputs = self.config, self.align_options.get("inputs")  # models in memory: symgraph.merge's inputs
        inputs = inputs if inputs is not None else self.data[0] if self.data else None
        return analyze(c.model, inputs, fold_norms=cfg.fold_norms, outputs=cfg.outputs)

    def run(self, steps: list) -> list:
        """Run ``steps`` (:mod:`.engine.steps`) in order, each timed under its name where it did work."""
        for step in steps:
            t0 = time.perf_counter()
            if step.run(self):
                self.timings[step.name] = time.perf_counter() - t0
        return steps

    def align(self):
        """The merge's steps up to its alignment, each once (:mod:`.engine.steps`): the anchor's meta
        model analysed (unaligned, only where the statistics or REPAIR run its graph), and each
        model of other widths, with the embedding rows weight matching reads; what is refused
        before any work; then every other checkpoint solved against the anchor (with
        ``anchor="universe"``, then rounds of aligning each to the mean of the others)."""
        analyze = steps.Analyze()
        rounds = [steps.Universe()] if self.config.anchor == "universe" else []
        self.run([analyze, steps.Refuse(), steps.Align(analyze), *rounds])
        return self.alignments

    def learning(self, target):
        """Learned matching's settings towards ``target`` (the anchor, or a universe's mean)."""
        from .learned import Learning
        res = self.resources
        return Learning(target, self.data, self.config.refine, self.align_options.get("refine_lr", 1e-3), res.device,
                        res.ledger, res.stats_bytes, res.budget is not None, res.solve_dtype,
                        self._solver_options(), res.progress)

    def _solver_options(self) -> dict:
        return {k: v for k, v in self.align_options.items() if k not in ENGINE_ONLY}

    @contextmanager
    def aligning_to(self, target, ra):
        """The one alignment step (of :meth:`align` and of a shared universe's rounds): a
        function ``solve(i, report_b)`` aligning checkpoint ``i`` (analysed as ``report_b``) to
        ``target`` (a checkpoint of the anchor's architecture, analysed as ``ra``; its folded view
        kept while the context is open), both read through norm-folded views, by weights or
        activations (with ``refine``, learned matching towards ``target``), full groups fitted
        from the stored tensors."""
        from ..alignment.driver import align_tensors
        res, opts = self.resources, self._solver_options()
        learning = self.learning(target) if self.config.refine else None
        dev = None if res.device.type == "cpu" else res.device
        fa = Folded(ra, target, res.cache_bytes, res.work_dtype, dev, res.ledger)
        gains = gauge(ra.folds, {n: target.get(n).to(res.device) for f in ra.folds for n in (f.gain, f.shift) if n})

        def solve(i, rb):
            c = self._checkpoints[i]
            fb = Folded(rb, c, res.cache_bytes, res.work_dtype, dev, res.ledger)
            acts = {} if self.align_mode != "activations" else dict(
                data=self.data, models=(target.model, c.model), fetch=(target.fetch, c.fetch),
                stats_budget=res.stats_bytes, device=dev)
            sides = Sides(target, c, (fa, fb), res.cache_bytes, res.ledger, dev)  # what full groups read
            try:
                if learning is not None:  # imported here: the engine loads nothing of a step it does not run
                    from .learned import refined
                    return refined(learning, c, ra, rb, (fa, fb), gains, sides, acts)
                return align_tensors(ra, rb, fa, fb, gains, exact_dtype=res.solve_dtype, sides=sides, **acts, **opts)
            finally:
                fb.clear()
        try:
            yield solve
        finally:
            fa.clear()

    def use(self, report, alignments):
        """Take the alignment step's result instead of running :meth:`align`: the anchor's
        ``report`` and one :class:`~symgraph.Alignment` (or None) per checkpoint, as
        :func:`symgraph.merge` finds them for models in memory (the anchor's own entry is not
        None only for a shared universe's basis)."""
        if self.config.repair:
            repair_stream.check(self._checkpoints[self.anchor].model, report)
        self.graph_report = report
        self.alignments = list(alignments)

    def averaging(self, keep, weights, method=None) -> StreamingMerge:
        """An engine of method ``average`` (or the ``method`` instance) over this one's
        checkpoints ``keep`` with mixing ``weights``, anchored at the first, its config
        otherwise this one's (without REPAIR or learned matching), its bytes counted in this
        one's ledger, each piece in float64 where the budget leaves room: a shared universe's means."""
        cfg = self.config.model_copy(update=dict(
            models=[self.config.models[j] for j in keep], weights=[float(w) for w in weights], anchor=0, out=None,
            method="average", parameters={}, repair=False, refine=0, attention="heads", untie=False))
        mean = StreamingMerge([self._checkpoints[j] for j in keep], cfg, method=method, ledger=self.resources.ledger)
        mean.resources.exact = torch.float64
        return mean

    def output_model(self):
        """The model (on ``meta``) the merged checkpoint builds: the anchor's, or with
        ``attention="circuits"`` its class with heads as wide as the circuit space."""
        circuits = self.transforms.circuits
        return circuits.built()[2] if circuits is not None else self._checkpoints[self.anchor].model

    def aligned(self, i) -> Aligned:
        """Checkpoint ``i`` in the anchor's basis, read on demand (``fetch(name)``, ``clear()``)
        in the work dtype, its cache sized and counted as this merge's."""
        res = self.resources
        return Aligned(self._checkpoints[i], self.alignments[i], self._checkpoints[self.anchor], self.graph_report,
                       res.work_dtype, res.cache_bytes, res.ledger)

    def merged_model(self, template):
        """The merge of models in memory (:meth:`write_into`) written into a copy of ``template``
        (the anchor's model) on its device, or for circuit-space heads into its class built from
        the widened config (:func:`~symgraph.merging.circuits.wide_model`)."""
        from .circuits import wide_model
        device = next((p.device for p in template.parameters()), torch.device("cpu"))
        out, finish = (wide_model(template, self.output_model().config, device) if self.config.attention == "circuits"
                       else (copy.deepcopy(template), None))
        targets = out.state_dict(keep_vars=True)

        def put(key, t):
            with torch.no_grad():
                targets[key].copy_(t)
        self.write_into(put, device=device)
        if finish is not None:
            finish(out)
        return out

    def prepare(self, scratch: str | None = None) -> StreamingMerge:
        """The steps between the alignment (run first where neither :meth:`align` nor :meth:`use`
        ran) and the writing, once (:mod:`.engine.steps`): the method's statistics, spilled to a
        temporary directory in ``scratch`` (default the ``scratch`` option; None: kept in memory)
        until :meth:`close`, the plan's transforms and REPAIR. What makes a merge need its models
        in memory is found here, before anything is written."""
        spill_parent = scratch if scratch is not None else self.align_options.get("scratch")
        if self.graph_report is None:  # neither align() nor use() ran (again, cheaply, where nothing needed one)
            self.align()
        if self.statistics.ready:
            return self
        try:
            self.run([steps.Statistics(spill_parent), steps.Widen(), steps.Repair()])
        except BaseException:
            self.close()
            raise
        self.statistics.ready = True
        return self

    def close(self) -> None:
        """The statistics' spill removed; a next write prepares again."""
        if self.spill is not None:
            self.spill.close()
        self.statistics.spill, self.statistics.ready = None, False

    def write(self, directory: str, shard: int | None = None) -> dict:
        """The merged checkpoint written into ``directory`` (shards of at most ``shard`` bytes,
        default the config's ``max_shard_size`` or 2 GiB, an index, the config), prepared first
        where :meth:`prepare` did not run (the statistics spilled beside ``directory``), closed
        after; returns ``{"tensors": n, "bytes": total, "shards": k}``."""
        shard = shard if shard is not None else self.config.shard_bytes or DEFAULT_SHARD
        anchor = self.prepare(os.path.dirname(os.path.abspath(directory))).checkpoints[self.anchor]
        return self._written(lambda plan: CheckpointWriter(anchor, directory, shard, plan.outputs,
                                                             self.transforms.config_updates))

    def write_into(self, add, device=None) -> dict:
        """The merge of models in memory (prepared first as :meth:`write` is, its statistics in
        memory): each merged tensor given to ``add(key, tensor)`` (in the anchor's dtype for that
        key, on ``device``: default the job's) as it is computed; returns
        ``{"tensors": n, "bytes": total, "shards": 0}``."""
        self.resources.out_device = torch.device(device) if device is not None else self.resources.device
        return self.prepare()._written(lambda plan: Into(add))

    def _written(self, make_sink) -> dict:
        """The plan run into ``make_sink(plan)`` (:class:`~.engine.steps.Write`), then closed."""
        try:
            return self.run([steps.Write(make_sink)])[0].info
        finally:
            self.close()

    def plan(self):
        """The plan of this merge (:class:`~.engine.plan.Plan`): its tasks in the anchor's key
        order, once the alignment is known."""
        return build_plan(self, self.graph_report, self.transforms.out_shapes)

    def executor(self, plan=None):
        """The :class:`~.engine.executor.Executor` of ``plan`` (default: :meth:`plan`) over this
        merge's alignments, method, statistics, device and ledger."""
        return Executor(plan or self.plan(), alignments=self.alignments, stats=self.statistics.per_model,
                        weights=self.weights, resources=self.resources, transforms=self.transforms,
                        elementwise_statistics=self.how.elementwise_statistics)

    def averaged(self, buffer) -> bool:
        """Whether the anchor's ``buffer`` is combined: a floating-point buffer some class moves
        (any one, without alignment); else the anchor's own is written."""
        dtype = self._checkpoints[self.anchor].dtypes[buffer]
        if dtype is None or not dtype.is_floating_point:
            return False
        if self.align_mode is None:
            return True
        assert self.report is not None  # aligned: write() runs align() first
        return buffer in self.report.buffers
