"""The shared universe out of core: ``symgraph merge a b c --anchor universe``.

The rounds of :func:`~.universe.run_rounds`, each leave-one-out mean an engine plan written
within the memory budget into a temporary checkpoint beside the output (marked as this run's,
removed once aligned to), each checkpoint aligned to it by the engine's one alignment step
(:meth:`StreamingMerge.aligning_to`); every held tensor is counted in the job's ledger."""
from __future__ import annotations

import tempfile
import time
from contextlib import contextmanager

from ..checkpoints.leftovers import mark_run
from ..core.files import identity, remove_own
from .streaming import StreamingMerge
from .universe import run_rounds, universe_options

__all__ = ["align_universe_streamed", "SCRATCH_PREFIX"]

#: The temporary directory of the rounds' means, beside the output (removed at the end).
SCRATCH_PREFIX = ".symgraph-tmp-universe-"


def align_universe_streamed(job: StreamingMerge, parent: str, options: dict | None = None) -> dict:
    """Align every checkpoint of ``job`` into one shared basis within its budget and hand the
    alignments to it; ``parent``: where the rounds' means are written (each removed after);
    ``options``: ``max_rounds``, ``tol`` (:data:`~.universe.DEFAULTS`). Returns the record."""
    opts = universe_options(options)
    t0 = time.perf_counter()
    alignments = list(job.align())  # round 0: the anchor merge
    record = run_rounds(job, job.report, alignments, _OnDisk(job, parent), opts, job.progress, t0)
    job.use(job.report, alignments)
    return record


class _OnDisk:
    """The rounds' steps out of core (module docstring): each mean in a temporary directory in ``parent``."""

    def __init__(self, job, parent):
        self.job, self.parent = job, parent

    @contextmanager
    def target(self, plan):
        scratch = tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=self.parent)
        made = identity(scratch)
        try:
            mark_run(scratch, None)
            plan.write(scratch)
            yield self.job.read(scratch)  # as the job reads its own checkpoints
        finally:
            remove_own(scratch, made, SCRATCH_PREFIX)

    def align(self, target, i, rb):  # the target has the anchor's architecture: the job's report
        with self.job.aligning_to(target, self.job.report) as solve:
            return solve(i, rb)
