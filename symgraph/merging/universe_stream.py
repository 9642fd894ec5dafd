"""The shared universe out of core: ``symgraph merge a b c --anchor universe``.

The rounds of :mod:`.universe` (MergeMany, Ainsworth et al., Git Re-Basin, Algorithm 3), each
step a plan of the merge engine instead of float32 states held in memory:

- round 0: every checkpoint aligned to the first (:meth:`StreamingMerge.align`, the anchor merge);
- round r ≥ 1: for i = 0..N-1 in turn, the weighted mean of the *other* checkpoints in the
  shared basis (their current alignments, model i's weight 0) is written by an engine of
  method ``average`` into a temporary checkpoint beside the output (marked as this run's,
  removed once aligned to; a killed run's is swept by the next run beside it), within the memory
  budget; the original checkpoint i is aligned to it, tensor by tensor
  (:func:`~symgraph.alignment.driver.align_tensors` through :class:`~.views.Folded` views, as
  the engine aligns any pair), and its alignment replaced at once (Gauss-Seidel);
- stop after the first round in which no element changed (:func:`~.universe.round_changes`,
  drift of the whole universe not counted), or after ``max_rounds``.

The merge then runs on the same engine with every checkpoint's alignment into the universe
(:meth:`StreamingMerge.use`). Every held tensor is counted in the job's
:class:`~.views.Ledger`, so its peak bounds the universe's rounds too. The record is the
in-memory one's (:func:`~.universe.align_universe`) less ``distance`` (a spread of whole states,
which no step here holds)."""
from __future__ import annotations

import sys
import tempfile
import time

from tqdm import tqdm

from ..checkpoints.leftovers import mark_run
from ..checkpoints.sharded import Checkpoint
from ..core.files import identity, remove_own
from ..transform.folding import gauge
from .streaming import StreamingMerge
from .universe import round_changes, universe_options
from .views import Folded, Sides

__all__ = ["align_universe_streamed", "SCRATCH_PREFIX"]

#: The temporary directory of the rounds' means, beside the output (removed at the end).
SCRATCH_PREFIX = ".symgraph-tmp-universe-"


def align_universe_streamed(job: StreamingMerge, parent: str, options: dict | None = None) -> dict:
    """Align every checkpoint of ``job`` (its anchor the first) into one shared basis, within
    its budget, and hand the alignments to it (:meth:`StreamingMerge.use`); ``parent``: the
    directory the rounds' means are written in (each a temporary directory, removed after);
    ``options``: ``max_rounds``, ``tol`` (:data:`~.universe.DEFAULTS`). Returns the record."""
    opts = universe_options(options)
    t0 = time.perf_counter()
    alignments = list(job.align())  # round 0: the anchor merge
    ra = job.report
    reports = [ra] + [al.report_b for al in alignments[1:]]
    record = {"rounds": 0, "converged": False, "stopped": "max_rounds", "changed": [], "changed_per_model": [],
              "drifted": [], "max_change": [], "round_seconds": [time.perf_counter() - t0],
              "max_rounds": opts["max_rounds"], "tol": opts["tol"]}
    n = len(job.ckpts)
    bar = tqdm(total=opts["max_rounds"] * n, desc=f"universe (align={job.align_mode})", unit="alignment",
               file=sys.stderr, leave=False, disable=not job.progress)
    try:
        for r in range(1, opts["max_rounds"] + 1):
            t1 = time.perf_counter()
            before = [al.elements if al is not None else {} for al in alignments]
            for i in range(n):
                scratch = tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=parent)
                made = identity(scratch)
                try:
                    mark_run(scratch, None)  # a killed run's mean is swept by the next run beside it
                    alignments[i] = _align_to(job, ra, reports[i], _mean(job, ra, alignments, i, scratch), i)
                finally:
                    remove_own(scratch, made, SCRATCH_PREFIX)
                bar.update()
            per_model, drifted, worst = round_changes(before, [al.elements for al in alignments], opts["tol"])
            record["rounds"] = r
            for key, value in (("changed", sum(per_model)), ("changed_per_model", per_model),
                               ("drifted", drifted), ("max_change", worst),
                               ("round_seconds", time.perf_counter() - t1)):
                record[key].append(value)
            if not any(per_model):
                record["converged"], record["stopped"] = True, "converged"
                break
    finally:
        bar.close()
    record["elements"] = [len(al.elements) for al in alignments]
    record["seconds"] = time.perf_counter() - t0
    job.use(ra, alignments)
    return record


def _mean(job, ra, alignments, i, directory) -> Checkpoint:
    """The weighted mean of every checkpoint but the ``i``-th in the shared basis, written by an
    engine plan (method ``average``, model ``i``'s weight 0) into ``directory``, read back as
    a checkpoint; its tensors are counted in ``job``'s ledger."""
    w = [0.0 if j == i else float(x) for j, x in enumerate(job.weights)]
    if sum(w) <= 0:  # every other model has weight 0: the plain mean of the others
        w = [0.0 if j == i else 1.0 for j in range(len(w))]
    plan = StreamingMerge(job.ckpts, weights=w, align=job.align_mode, anchor=0, fold_norms=job.fold_norms,
                          outputs=job.outputs, device=job.device, memory_budget=job.memory_budget,
                          cache_bytes=job.cache_bytes,  # the data the alignment mode says it was solved on
                          data=job.data if job.align_mode == "activations" else None)
    plan.ledger = job.ledger
    plan.use(ra, alignments)
    plan.write(directory)
    target = Checkpoint(directory)
    if len({c.dtype for c in job.ckpts}) > 1:  # the job's graphs run in its work dtype (StreamingMerge)
        target.model = target.retyped(job.work_dtype)
    return target


def _align_to(job, ra, rb, target, i):
    """Checkpoint ``i`` of ``job`` aligned to the checkpoint ``target`` (of the anchor's
    architecture, analysed as ``ra``), read through folded views as :meth:`StreamingMerge.align`
    reads any pair."""
    from ..alignment.driver import align_tensors
    c = job.ckpts[i]
    dev = None if job.device.type == "cpu" else job.device
    fa = Folded(ra, target, job.cache_bytes, job.work_dtype, dev, job.ledger)
    fb = Folded(rb, c, job.cache_bytes, job.work_dtype, dev, job.ledger)
    gains = gauge(ra.folds, {n: target.get(n).to(job.device) for f in ra.folds for n in (f.gain, f.shift) if n})
    acts = {} if job.align_mode != "activations" else dict(
        data=job.data, models=(target.model, c.model), fetch=(target.fetch, c.fetch), stats_budget=job.stats_bytes,
        device=dev)
    sides = Sides(target, c, (fa, fb), job.cache_bytes, job.ledger, dev)
    try:
        return align_tensors(ra, rb, fa, fb, gains, exact_dtype=job.work_dtype, sides=sides, **acts,
                             **job.align_options)
    finally:
        fa.clear()
        fb.clear()
