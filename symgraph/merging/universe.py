"""N models in one universe: ``merge(models, anchor="universe")``.

Aligning every model to one anchor biases the merge toward it, and never matches the others
to each other. Here every model is aligned to the mean of the *others* (MergeMany, Ainsworth
et al., Git Re-Basin, ICLR 2023, Algorithm 3); as in C2M3 (Crisostomi et al. 2024) every model
has one map into a shared basis, so the maps between any two, through it, are cycle-consistent:

- round 0: every model aligned to ``models[0]`` (the anchor merge, which ``models[0]`` enters
  with the identity);
- round r ≥ 1: for each model i in turn, the weighted mean of the others in the shared basis
  (an engine plan, method ``average``, model i's weight 0: :func:`mean_plan`) is the target
  the *original* model i is aligned to, its alignment replaced at once (Gauss-Seidel);
- stop after a round that changed no element of any model (``converged``), or ``max_rounds``.

An element is unchanged when it is the same permutation, or a matrix / transport map whose
entries moved by at most ``tol``. A class in which every model moved by one common element in
a round has *drifted* (the basis turning as a whole, e.g. a common rotation of RoPE pairs): not
counted as a change, as it changes neither the average's function nor any model's place.

Elements are solved by the usual solvers, so heterogeneous widths, activations, ``refine`` and
every merge method work as with an anchor; where norm gains fold, every state carries
``models[0]``'s gains. The rounds (:func:`run_rounds`) are one loop of the merge engine's
steps (:func:`rounds`, the engine's ``Universe`` step), in memory and out of core within the budget.
"""
from __future__ import annotations

import math
import tempfile
import time
from contextlib import contextmanager

import torch

from ..checkpoints.leftovers import mark_run
from ..checkpoints.memory import ModelCheckpoint
from ..core.elements import Map, Perm
from ..core.files import identity, remove_own
from ..core.progress import bar as progress_bar, note
from ..errors import InputError
from .methods.average import Average

__all__ = ["DEFAULTS", "SCRATCH_PREFIX", "rounds", "universe_options",
           "round_changes", "run_rounds", "mean_plan", "Spread"]

#: ``universe_options`` of :func:`symgraph.merge` and their defaults.
DEFAULTS = {"max_rounds": 10, "tol": 1e-4}
#: The temporary directory of the rounds' means out of core, beside the output (removed at the end).
SCRATCH_PREFIX = ".symgraph-tmp-universe-"


def universe_options(options: dict | None) -> dict:
    """``options`` checked and completed with :data:`DEFAULTS`."""
    if options is not None and not isinstance(options, dict):
        raise InputError(f"universe_options is a {type(options).__name__}; expected a dict of some of "
                         f"{sorted(DEFAULTS)}")
    options = dict(options or {})
    bad = sorted(set(options) - set(DEFAULTS))
    if bad:
        raise InputError(f"unknown universe option(s) {bad}; expected some of {sorted(DEFAULTS)}")
    out = DEFAULTS | options
    r, tol = out["max_rounds"], out["tol"]
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise InputError(f"universe max_rounds={r!r}; expected a positive integer (rounds of "
                         "aligning every model to the mean of the others)")
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not math.isfinite(tol) or tol < 0:
        raise InputError(f"universe tol={tol!r}; expected a number >= 0 (the largest entry "
                         "change of a matrix element that counts as unchanged)")
    return out


def rounds(job, parent: str | None = None, options: dict | None = None) -> dict:
    """Align every model of ``job`` (the merge engine over them, aligned to model 0: round 0)
    into one shared basis and hand the alignments to it (``job.alignments``): out of core
    within its budget, each round's means written into ``parent`` (each removed after), or
    with ``parent`` None in memory, each mean a model in memory; ``options``: ``max_rounds``
    and ``tol`` (:data:`DEFAULTS`). The engine runs it as its align step
    :class:`~symgraph.merging.engine.steps.Universe` (``anchor="universe"``).

    Returns a JSON-able record: ``rounds``, ``converged``, ``stopped`` ("converged" /
    "max_rounds"), per round ``changed`` (elements, all models), ``changed_per_model``,
    ``drifted`` (:func:`round_changes`), ``max_change`` and ``round_seconds`` (round 0 first),
    ``distance`` (round 0 first: ``Σ w_i‖θ_i − θ̄‖² / Σ w_i‖θ_i‖²``, :class:`Spread`);
    ``elements`` per model, ``max_rounds``, ``tol``, ``seconds``.
    """
    opts = universe_options(options)
    t0 = time.perf_counter() - job.timings.get("align", 0.0)  # round 0: the anchor merge, just run
    steps = _InMemory(job, None) if parent is None else _OnDisk(job, parent)
    return run_rounds(job, job.report, job.alignments, steps, opts, job.progress, t0)  # replaced in place


class _OnDisk:
    """The rounds' steps out of core: each mean in a temporary directory in ``parent``, read as
    the job reads its own checkpoints; each model aligned to it by the job's own step (the
    target has the anchor's architecture: the job's report)."""

    def __init__(self, job, parent):
        self.job, self.parent = job, parent

    @contextmanager
    def target(self, plan):
        scratch = tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=self.parent)
        made = identity(scratch)
        try:
            mark_run(scratch, None)
            plan.write(scratch)
            yield self.job.read(scratch)
        finally:
            remove_own(scratch, made, SCRATCH_PREFIX)

    def align(self, target, i, rb):
        with self.job.aligning_to(target, self.job.report) as solve:
            return solve(i, rb)


class _InMemory(_OnDisk):
    """The rounds' steps for models in memory: each mean written into a copy of the anchor's model."""

    @contextmanager
    def target(self, plan):
        mean = plan.merged_model(self.job.checkpoints[0].model)
        yield ModelCheckpoint(mean, "the universe's mean")


def run_rounds(job, ra, alignments: list, steps, opts: dict, progress: bool, t0: float) -> dict:
    """The rounds r ≥ 1 from round 0's ``alignments`` (replaced in place), in memory and out of
    core: ``job`` the merge engine over every model, ``ra`` the anchor's report, ``steps`` where
    a mean goes (``steps.target(plan)``: a context holding the mean ``plan`` writes) and how a
    model is aligned to it (``steps.align(target, i, report_b)``). Each round's ``distance`` is
    measured by its first plan (model 0's mean reads every model), the last by one more plan.
    Returns the record (:func:`rounds`)."""
    n, weights = len(job.checkpoints), job.weights
    reports = [ra] + [al.report_b for al in alignments[1:]]
    record = {"rounds": 0, "converged": False, "stopped": "max_rounds", "changed": [], "changed_per_model": [],
              "drifted": [], "max_change": [], "distance": [], "round_seconds": [time.perf_counter() - t0],
              "max_rounds": opts["max_rounds"], "tol": opts["tol"]}
    with progress_bar(total=opts["max_rounds"] * n, desc=f"universe (align={job.config.align})", unit="alignment",
                      enabled=progress) as bar:
        for r in range(1, opts["max_rounds"] + 1):
            t1 = time.perf_counter()
            before = [al.elements if al is not None else {} for al in alignments]
            for i in range(n):
                spread = Spread(job.checkpoints[0], weights) if i == 0 else None
                with steps.target(mean_plan(job, ra, alignments, i, spread)) as target:
                    record["distance"] += [spread.value()] if spread else []
                    alignments[i] = steps.align(target, i, reports[i])
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
    spread = Spread(job.checkpoints[0], weights)
    mean_plan(job, ra, alignments, None, spread).write_into(lambda key, t: None)
    record["distance"].append(spread.value())
    record["elements"] = [len(al.elements) for al in alignments]
    record["seconds"] = time.perf_counter() - t0
    if not record["converged"]:
        note(f"the shared universe stopped at max_rounds={opts['max_rounds']} with {record['changed'][-1]} elements "
             "still changing in its last round; the merge takes that round's alignments (more rounds: "
             "universe_options max_rounds)", "warning")
    return record


def mean_plan(job, ra, alignments, i=None, method=None):
    """An engine plan (method ``average``, or the ``method`` instance) over ``job``'s checkpoints
    in the shared basis (``alignments``): the weighted mean of every model but the ``i``-th (the
    plain mean of the others where their weights are 0), or of all with ``i`` None. Model 0,
    whose keys and dtypes the mean has, is read even at weight 0; another model left out is
    not, unless only one other is left or the dtypes differ (the work dtype depends on all)."""
    ckpts, weights = job.checkpoints, job.weights
    keep = [j for j in range(len(ckpts)) if j != i or j == 0]
    if len(keep) < 2 or len({c.dtype for c in ckpts}) > 1:
        keep = list(range(len(ckpts)))
    w = [0.0 if j == i else float(weights[j]) for j in keep]
    plan = job.averaging(keep, w if sum(w) > 0 else [0.0 if j == i else 1.0 for j in keep], method)
    plan.use(ra, [alignments[j] for j in keep])
    return plan


class Spread(Average):
    """Method ``average`` measuring ``Σ_i w_i ‖θ_i − θ̄‖² / Σ_i w_i ‖θ_i‖²`` (:meth:`value`) as a
    plan reading every model combines the tensors (``anchor``: the checkpoint whose shapes the
    merge has). A group merged in slices combines its unsliced members once per slice: they
    count once."""

    def __init__(self, anchor, weights):
        super().__init__()
        self.anchor, self.w = anchor, [float(x) for x in weights]
        self.whole: dict = {}
        self.sliced = [0.0, 0.0]

    def combine_group(self, names, values, stats, weights, report):
        for k in names:
            mean = sum(x * v[k] for x, v in zip(self.w, values))
            sums = (sum(x * float(((v[k] - mean).double() ** 2).sum()) for x, v in zip(self.w, values)),
                    sum(x * float((v[k].double() ** 2).sum()) for x, v in zip(self.w, values)))
            if tuple(mean.shape) == tuple(self.anchor.shapes[self.anchor.key(k)]):
                self.whole[k] = sums
            else:
                self.sliced = [self.sliced[0] + sums[0], self.sliced[1] + sums[1]]
        return super().combine_group(names, values, stats, weights, report)

    def value(self) -> float:
        num = self.sliced[0] + sum(a for a, _ in self.whole.values())
        den = self.sliced[1] + sum(b for _, b in self.whole.values())
        return num / den if den > 0 else 0.0


def round_changes(before, after, tol):
    """One round's changes: (per model the number of its elements that changed, the number of
    groups that only drifted, the largest entry change of a matrix element). ``before`` /
    ``after``: each model's elements at the round's start and end (missing: the identity). A
    group whose every model moved by one step ``E_i' E_i⁻¹ = D`` (within ``tol``) drifted: the
    merge is then ``D`` applied to the same average, the same function."""
    n, worst, drifted = len(after), 0.0, 0
    per_model = [0] * n
    for gid in set().union(*before, *after):
        moved = []
        for i in range(n):
            d = _difference(before[i].get(gid), after[i].get(gid))
            worst = max(worst, d) if d is not None else worst
            moved.append(d is None or d > tol)
        if not any(moved):
            continue
        steps = [_step(b.get(gid), a.get(gid)) for b, a in zip(before, after)]
        if all(st is not None for st in steps) and all(_same_step(steps[0], st, tol) for st in steps[1:]):
            drifted += 1
            continue
        for i in range(n):
            per_model[i] += moved[i]
    return per_model, drifted, worst


def _step(a, b):
    """``D`` with ``b = D a`` (``a`` None: the identity) as an index vector for permutations
    or a ``[*fibres, n, n]`` matrix; None where there is none (rectangular or soft maps)."""
    if isinstance(b, Map) or isinstance(a, Map):
        return None
    if (a is None or isinstance(a, Perm)) and isinstance(b, Perm):
        if a is None:
            return b.index
        inv = torch.empty_like(a.index)
        inv[a.index] = torch.arange(len(a.index), device=a.index.device)
        return inv[b.index.to(a.index.device)]  # index'[r] = index[d[r]]
    if b is None or isinstance(b, Perm) or isinstance(a, Perm):
        return None
    if b.shape[-1] != b.shape[-2] or (a is not None and a.shape != b.shape):
        return None
    b = b.to(torch.float64)
    if a is None:
        return b
    a = a.to(device=b.device, dtype=torch.float64)
    try:  # D = b a⁻¹, i.e. aᵀ Dᵀ = bᵀ
        return torch.linalg.solve(a.mT, b.mT).mT
    except RuntimeError:  # a singular element: no step
        return None


def _same_step(x, y, tol):
    if x.dtype == torch.long or y.dtype == torch.long:
        return x.dtype == y.dtype and torch.equal(x, y.to(x.device))
    return x.shape == y.shape and float((x - y.to(x.device)).abs().max()) <= tol


def _difference(a, b):
    """The largest entry difference of two elements (a missing one is the identity); None where
    they differ not by degree (two different permutations, or different shapes)."""
    if a is None and b is None:
        return 0.0
    if all(x is None or isinstance(x, Perm) for x in (a, b)):
        n = len((a if a is not None else b).index)
        ia, ib = (torch.arange(n) if x is None else x.index.cpu() for x in (a, b))
        return 0.0 if torch.equal(ia, ib) else None
    ma, mb = _matrix(a, b), _matrix(b, a)
    if ma.shape != mb.shape:
        return None
    return float((ma.to(torch.float64) - mb.to(device=ma.device, dtype=torch.float64)).abs().max())


def _matrix(el, other):
    """``el`` as a dense tensor (a transport map's ``co``); None becomes the identity shaped
    like ``other``."""
    if el is None:
        m = _matrix(other, None)
        if m.shape[-1] != m.shape[-2]:
            return torch.zeros(0)  # a rectangular map is never the identity
        return torch.eye(m.shape[-1], dtype=torch.float64, device=m.device).expand(m.shape)
    if isinstance(el, Perm):
        return el.dense()
    return el.co if isinstance(el, Map) else el
