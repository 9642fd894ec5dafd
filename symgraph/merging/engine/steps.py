"""The merge's steps, in the order :class:`~symgraph.merging.streaming.StreamingMerge` runs
them: :class:`Analyze`, :class:`Refuse`, :class:`Align` and, for a shared universe,
:class:`Universe` (its ``align``), then :class:`Statistics`, :class:`Widen` and :class:`Repair` (its
``prepare``) and :class:`Write` (its ``write`` and ``write_into``). Each step reads and sets the engine's state and says
whether it did work; the engine then times it under the step's ``name``.
"""
from __future__ import annotations

from ...core.progress import bar as progress_bar
from .. import repair_stream
from . import slicing
from .measuring import RepairContext
from .statistics import StatisticsContext, take
from .sums import MemorySpill, Spill

__all__ = ["Analyze", "Refuse", "Align", "Universe", "Statistics", "Widen", "Repair", "Write"]


class Analyze:
    """The anchor analysed where the merge is aligned, or where the statistics, REPAIR or
    circuit-space heads read its graph; each other model of other widths analysed (``others``: index -> report); the
    embedding rows weight matching reads (``seen_rows``)."""
    name = "analyze"

    others: dict = {}

    def run(self, job) -> bool:
        A, aligned = job.checkpoints[job.anchor], job.align_mode is not None
        runs_graph = job.how.needs_data or job.config.repair or job.transforms.circuits is not None
        if aligned or (runs_graph and job.graph_report is None):
            job.graph_report = job.analyzed(A)
        ra = job.graph_report
        self.others = {i: ra if c.shapes == A.shapes else job.analyzed(c)  # a model of other widths: its own
                       for i, c in enumerate(job.checkpoints) if aligned and i != job.anchor}
        if aligned and job.align_options.get("rows_from"):  # only their tokens' embedding rows
            job.align_options = {**job.align_options, "rows": ra.input_rows(job.align_options["rows_from"])}
        return aligned


class Refuse:
    """Refused before any work: a BatchNorm REPAIR cannot reset, learned matching's room, the
    plan's largest piece in the memory budget."""
    name = "refuse"

    def run(self, job) -> bool:
        ra, aligned = job.graph_report, job.align_mode is not None
        if job.config.repair:
            repair_stream.check(job.checkpoints[job.anchor].model, ra)
        eye = slicing.identity_alignment(ra) if aligned and job.resources.budget is not None else None
        if job.config.refine:  # imported here: the engine loads nothing of a step it does not run
            from ..learned import check_budget
            check_budget(job.learning(job.checkpoints[job.anchor]), eye)
        slicing.check_floor(job, eye)
        return False


class Align:
    """Every other checkpoint (analysed by ``analyze``) solved against the anchor, one
    alignment each (:meth:`~symgraph.merging.streaming.StreamingMerge.aligning_to`)."""
    name = "align"

    def __init__(self, analyze: Analyze):
        self.analyze = analyze

    def run(self, job) -> bool:
        if job.align_mode is None:  # nothing to move: every tensor is combined as it is
            return False
        others = self.analyze.others
        with job.aligning_to(job.checkpoints[job.anchor], job.graph_report) as solve, progress_bar(
                total=len(others), desc="aligning", unit="model", enabled=job.progress) as bar:
            for i, rb in others.items():
                job.alignments[i] = solve(i, rb)
                bar.update()
        return True


class Universe:
    """A shared universe (``anchor="universe"``): from the :class:`Align` step's round 0, rounds
    of aligning each model to the mean of the others (:func:`symgraph.merging.universe.rounds`),
    their means in the ``scratch`` directory (None: memory); the record is the engine's
    ``universe``."""
    name = "universe"

    def run(self, job) -> bool:
        from ..universe import rounds  # imported here: the engine loads nothing of a step it does not run
        job.universe = rounds(job, job.align_options.get("scratch"), job.align_options.get("universe"))
        return True


class Statistics:
    """The method's statistics (its declared kind, :mod:`.statistics`) for every model, where it
    takes any, held in a spill: a temporary directory in ``spill_parent`` (None: memory)."""
    name = "statistics"

    def __init__(self, spill_parent: str | None = None):
        self.spill_parent = spill_parent

    def run(self, job) -> bool:
        if not job.how.needs_data:
            return False
        job.spill = MemorySpill() if self.spill_parent is None else Spill(self.spill_parent)
        context = StatisticsContext.of(job)  # what the takers read, not the engine
        job.statistics.per_model = [take(job.how.statistic, context, i) for i in range(len(job.checkpoints))]
        return True


class Widen:
    """Circuit-space heads: their shapes, config fields and combine, for the plan to write."""
    name = "widen"

    def run(self, job) -> bool:
        if job.transforms.circuits is not None:
            job.transforms.apply(job.transforms.circuits.widening())
        return False


class Repair:
    """REPAIR (``repair=True``), last: it measures the merge as written (``repair_report``)."""
    name = "repair"

    def run(self, job) -> bool:
        if job.config.repair:
            job.repair_report = repair_stream.repair(RepairContext.of(job))
        return False


class Write:
    """The plan (:meth:`~symgraph.merging.streaming.StreamingMerge.plan`) run by its executor into
    ``make_sink(plan)``; ``info``: what the sink wrote."""
    name = "write"

    def __init__(self, make_sink):
        self.make_sink, self.info = make_sink, None

    def run(self, job) -> bool:
        sink = self.make_sink(plan := job.plan())
        job.executor(plan).run(sink, job.progress)
        self.info = sink.close()
        return True
