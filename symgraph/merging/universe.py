"""N models in one universe: ``merge(models, anchor="universe")``.

Aligning every model to one anchor biases the merge toward the anchor, and models 1..N-1 are
never matched to each other. Here every model is aligned to the mean of the *others* instead
(MergeMany, Ainsworth et al., Git Re-Basin, ICLR 2023, Algorithm 3). As in C2M3's universe
(Crisostomi et al. 2024; there solved jointly by Frank-Wolfe) every model has one map into a
shared basis, so the maps between any two models, through it, are cycle-consistent. The rounds:

- round 0: every model aligned to ``models[0]`` (the anchor merge), giving each model's state
  in one shared basis;
- round r ≥ 1: for i = 0..N-1 in turn, the weighted mean of the other models' current states
  (the leave-one-out mean, a copy of ``models[0]`` holding it, so :func:`symgraph.align` can
  trace it) becomes the target, the *original* model i is aligned to it, and model i's state
  is replaced at once (Gauss-Seidel: the next model sees it);
- stop after the first round in which no element of any model changed (``converged``), or
  after ``max_rounds``.

An element is unchanged when it is the same permutation, or a matrix / transport map whose
entries moved by at most ``tol`` (rotations and Sinkhorn maps are found by continuous solvers;
bitwise equality would only come at a float fixed point). ``models[0]`` enters round 0 with the
identity. The universe's basis itself is only defined up to one group element applied to every
model; a class in which every model moved by the same element in a round (the rounds turning
the whole universe, as a steady common rotation of RoPE pairs does) has *drifted*, which
changes neither the average's function nor any model's place relative to the others, and is
not counted as a change.

Every element is solved by the usual solvers (Hungarian, Procrustes, RoPE, OT, or Sinkhorn
with ``solver="sinkhorn"``), so heterogeneous widths, activations, ``refine`` and every merge
method (statistics are then moved with, or measured on, each model's final alignment) work as
with an anchor. Where norm gains fold, every state carries the gains of the
target it was aligned to, which are ``models[0]``'s from round 0 on.

Cost: round 0 plus up to ``max_rounds`` rounds of N alignments (reports are computed once per
model); N float32 states are held, and each returned alignment keeps its target model (the
template :meth:`~symgraph.Alignment.apply` needs for other widths), so memory grows by about N
copies of ``models[0]`` in its dtype.
"""
from __future__ import annotations

import copy
import math
import sys
import time

import torch
from tqdm import tqdm

from ..alignment import align as align_models
from ..transform.apply import write_state
from ..core.elements import Map, Perm
from ..errors import InputError
from .state import aligned_state

__all__ = ["DEFAULTS", "align_universe", "universe_options", "round_changes"]

#: ``universe_options`` of :func:`symgraph.merge` and their defaults.
DEFAULTS = {"max_rounds": 10, "tol": 1e-4}


def universe_options(options: dict | None) -> dict:
    """``options`` checked and completed with :data:`DEFAULTS`."""
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


def align_universe(models, inputs, ra, align, data, weights, options=None, progress=False,
                   **align_options):
    """Align every model of ``models`` into one shared basis (module docstring).

    ra : ``models[0]``'s report (every target has its architecture); align : "weights" or
    "activations"; weights : the normalised mixing weights (the leave-one-out means use them
    renormalised); options : ``max_rounds``, ``tol`` (:data:`DEFAULTS`).

    Returns ``(alignments, record)``: per model the :class:`~symgraph.Alignment` of the
    original model into the universe (``models[0]``'s included), and a JSON-able record:
    ``rounds`` (universe rounds run after round 0), ``converged`` (the last round changed
    nothing), ``stopped`` ("converged" / "max_rounds"), per round ``changed`` (elements that
    changed, all models), ``changed_per_model``, ``drifted`` (groups whose every model moved by
    one common element: the universe's basis turning as a whole, see :func:`round_changes`; not a
    change), ``max_change`` (largest entry change of a matrix element, 0 when there are none),
    ``distance`` (round 0 first: ``Σ w_i‖θ_i − θ̄‖² / Σ w_i‖θ_i‖²``, the spread MergeMany
    shrinks), ``round_seconds`` (round 0 first); ``elements`` (per model), ``max_rounds``,
    ``tol``, ``seconds`` (total).
    """
    opts = universe_options(options)
    t0 = time.perf_counter()
    n, A = len(models), models[0]
    kw = dict(align_options, data=data if align == "activations" or align_options.get("refine") else None)
    total = n - 1 + opts["max_rounds"] * n
    bar = tqdm(total=total, desc=f"universe (align={align})", unit="alignment", file=sys.stderr,
               leave=False, disable=not progress)
    alignments, states = [None], [aligned_state(A, None, ra)]
    for m in models[1:]:  # round 0: the anchor merge
        alignments.append(align_models(A, m, inputs, report_a=ra, **kw))
        states.append(aligned_state(m, alignments[-1], ra))
        bar.update()
    reports = [ra] + [al.report_b for al in alignments[1:]]
    record = {"rounds": 0, "converged": False, "stopped": "max_rounds", "changed": [],
              "changed_per_model": [], "drifted": [], "max_change": [],
              "distance": [_spread(states, weights)],
              "round_seconds": [time.perf_counter() - t0], "max_rounds": opts["max_rounds"],
              "tol": opts["tol"], "elements": [len(al.elements) if al else 0 for al in alignments]}
    for r in range(1, opts["max_rounds"] + 1):
        t1 = time.perf_counter()
        before = [al.elements if al is not None else {} for al in alignments]
        for i, m in enumerate(models):
            target = _mean_model(A, states, weights, i, ra)
            # activation statistics run a report's own graph with the weights it was traced with:
            # the target's report is the target's (ra would measure models[0]'s activations)
            own = kw.get("data") is not None
            alignments[i] = align_models(target, m, inputs, report_a=None if own else ra, report_b=reports[i], **kw)
            states[i] = aligned_state(m, alignments[i], ra)
            bar.update()
        per_model, drifted, worst = round_changes(before, [al.elements for al in alignments], opts["tol"])
        record["rounds"] = r
        record["changed"].append(sum(per_model))
        record["changed_per_model"].append(per_model)
        record["drifted"].append(drifted)
        record["max_change"].append(worst)
        record["distance"].append(_spread(states, weights))
        record["round_seconds"].append(time.perf_counter() - t1)
        if not any(per_model):
            record["converged"], record["stopped"] = True, "converged"
            break
    bar.close()
    record["elements"] = [len(al.elements) for al in alignments]
    record["seconds"] = time.perf_counter() - t0
    return alignments, record


def _mean_model(A, states, weights, i, ra):
    """A copy of ``A`` holding the weighted mean of every state but the ``i``-th (float32 sums,
    written in ``A``'s dtypes)."""
    others = [(float(w), s) for j, (w, s) in enumerate(zip(weights, states)) if j != i]
    norm = sum(w for w, _ in others)
    if norm <= 0:  # every other model has weight 0: the plain mean of the others
        others, norm = [(1.0, s) for _, s in others], float(len(others))
    mean = {}
    for k, v in others[0][1].items():
        if v.is_floating_point():
            acc = torch.zeros_like(v)
            for w, s in others:
                acc.add_(s[k], alpha=w / norm)
            mean[k] = acc
        else:
            mean[k] = v  # integer buffers (e.g. num_batches_tracked): the first's
    out = copy.deepcopy(A)
    write_state(out, mean, ra.buffers)
    return out


def round_changes(before, after, tol):
    """One round's changes: (per model the number of its elements that changed, the number of
    groups that moved only as a whole, the largest entry change of a matrix element).

    ``before`` / ``after``: each model's elements at the start and end of the round (a missing
    element is the identity). The universe's basis is defined up to one element ``D`` applied
    to every model, and the rounds may drift along it (e.g. a steady common rotation of RoPE
    pairs): a group whose every model moved by the same step ``E_i' E_i⁻¹ = D`` (within
    ``tol``) counts as drifted, not changed — the merge is then ``D`` applied to the same
    average, the same function."""
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
    """The largest entry difference of two elements (None: they differ and the difference is
    not a matter of degree: two different permutations or different shapes; 0.0 for equal
    permutations). A missing element is the identity."""
    if isinstance(a, Perm) and isinstance(b, Perm):
        return 0.0 if torch.equal(a.index, b.index.to(a.index.device)) else None
    if (a is None or isinstance(a, Perm)) and (b is None or isinstance(b, Perm)):
        ia = None if a is None else a.index
        ib = None if b is None else b.index
        if ia is None and ib is None:
            return 0.0
        idx = ib if ia is None else ia
        return 0.0 if torch.equal(idx.cpu(), torch.arange(len(idx))) else None
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


def _spread(states, weights):
    """``Σ_i w_i ‖θ_i − θ̄‖² / Σ_i w_i ‖θ_i‖²`` over the floating-point tensors,
    ``θ̄ = Σ_i w_i θ_i``."""
    num = den = 0.0
    for k, v in states[0].items():
        if not v.is_floating_point():
            continue
        mean = sum(float(w) * s[k] for w, s in zip(weights, states))
        for w, s in zip(weights, states):
            num += float(w) * float(((s[k] - mean).double() ** 2).sum())
            den += float(w) * float((s[k].double() ** 2).sum())
    return num / den if den > 0 else 0.0
