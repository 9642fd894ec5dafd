"""The coordinate-descent loop: sweep over the solve units until they settle (``until``: no
element changes; no discrete one; or, the default, no discrete one and no solve closing a real
share of its unit's gap to the Cauchy–Schwarz bound).

The first sweep runs in dependency order (:func:`~.schedule.first_sweep_order`) and uses only
the slots whose other axes are already known; later sweeps re-solve a unit only if it left
slots out or something it used has changed since. Under ``torch.distributed`` the processes
share the solves (:mod:`.shared`), with one process's elements bit for bit.
"""
from __future__ import annotations

import torch

from ..core.elements import Map, Perm, is_perm
from ..core.progress import bar
from .schedule import first_sweep_order, units
from .shared import Waves
from .solve_unit import solve_unit

__all__ = ["Sweeps", "GAP_SHARE"]

# until="gap": a sweep whose solves each closed less than this share of their unit's gap to the
# Cauchy–Schwarz bound (and changed no discrete element) is the last
GAP_SHARE = 0.05


class Sweeps:
    """Elements, solver results and change counts of one alignment, and the loop filling them.

    ``similarity(group, cross_fibres, usable)`` returns ``(S, complete, deps)`` (see
    :meth:`~.weights.WeightFeatures.similarity`); ``versions`` is shared with it.
    """

    def __init__(self, report_a, opts, feats, similarity):
        self.opts, self.feats, self.similarity = opts, feats, similarity
        self.elements: dict = {}
        self.results: dict = {}
        self.versions = feats.versions  # group id -> number of times its element changed
        self.solver_seconds = 0.0
        self.units = [u for u in units(report_a) if u.groups(opts.selected)]
        self.changed = False
        self.moved = False  # a discrete element changed in this sweep (see _discrete_change)
        self.closed = 0.0  # the largest share of its gap a unit's solve closed in this sweep (see _progress)
        self.discrete_at: dict = {}  # group id -> its version at its last discrete change
        self.masses = None  # group -> unit masses or None, with .deps(group): see .masses
        self.presolved: dict = {}  # unit index -> what its early solve used (solve_early)
        self.deferred = 0  # unit solves postponed while other units still changed (see run)
        self.shared: dict = {}  # how the work was split between processes (see .shared)
        if opts.until == "gap" and getattr(feats, "bounds", 0) is None:  # read by this rule alone
            feats.bounds = {}  # the similarity's Cauchy–Schwarz bounds (see _progress)
        rb = getattr(feats, "rb", None)
        self.dims_b = {} if rb is None else {g.id: g.dim for g in rb.groups}
        for u in self.units:  # a member's slots that its inner members' own slots hold too
            for m in u.members if u.deep else ():
                inner = frozenset(x.id for x in u.members if m.id in x.outer)
                if inner and hasattr(feats, "nested"):
                    feats.nested[m.id] = inner
            if hasattr(feats, "share_maps"):
                feats.share_maps(self.solved_groups(u))

    def ids(self, unit) -> set:
        return {g.id for g in unit.groups(self.opts.selected)}

    def solved_groups(self, unit) -> list:
        return [unit.outer] if unit.kind == "single" else [m for m in unit.members if self.opts.selected(m)]

    def run(self, sweeps: int) -> int:
        """Sweep at most ``sweeps`` times; returns the number of sweeps run.

        A unit whose last re-solve kept its elements (a *stable* unit: typically an MLP's
        permutation once the residual stream has settled) is deferred while other units are
        still changing, except in the last allowed sweep: the rest (rotations, heads) converge
        without recomputing its similarity each time it reads a changed rotation. When a
        sweep changes nothing else, the deferred units are re-solved against the converged
        rest; the loop ends only when that changes nothing either, so the result is the same
        kind of fixed point as without deferral. With ``until="discrete"`` "nothing" means no
        discrete element from the second sweep on (with ``"gap"``, nor a solve closing
        :data:`GAP_SHARE` of its unit's gap), and a deferred unit is re-solved only if a class
        it reads changed discretely since its last solve."""
        last: dict = {}  # unit index -> (versions of the classes it used, complete)
        stable: set = set()
        order = first_sweep_order(self.units, self.ids, self.solved_groups, self.feats)
        waves = Waves(self, last, stable)  # one process: each unit solved as it is added
        sweep = 0
        for sweep in range(sweeps):
            self.changed = self.moved = False
            self.closed = 0.0
            pending = set().union(*(self.ids(u) for u in self.units)) if sweep == 0 else set()
            deferred = []
            for ui in bar(order, desc=f"aligning: sweep {sweep + 1}", unit="unit"):
                waves.before(ui)  # several processes: solve the wave first if ui reads it
                if sweep == 0 and ui in self.presolved:
                    pending -= self.ids(self.units[ui])
                    last[ui] = self.presolved[ui]
                    continue
                if sweep > 0 and self._current(ui, last):
                    continue  # nothing it depends on changed since it was solved
                if sweep > 1 and ui in stable and sweep < sweeps - 1 and self.opts.defer:
                    deferred.append(ui)
                    self.deferred += 1
                    continue
                pending -= self.ids(self.units[ui])
                waves.add(ui, pending, sweep)
            waves.flush()
            if not self._going(sweep) and deferred:
                for ui in deferred:  # the rest has converged: check the deferred units against it
                    waves.before(ui)
                    if not self._current(ui, last) and self._recheck(ui, last):
                        waves.add(ui, pending, sweep)
                waves.flush()
            if not self._going(sweep):
                break
        self.shared = waves.summary()
        return sweep + 1

    def _going(self, sweep) -> bool:
        """Whether the sweep just run calls for another (``until``, see AlignOptions): anything
        changed ("exact"); from the second sweep on, a discrete element ("discrete"), or a
        discrete element or a solve that closed :data:`GAP_SHARE` of its unit's gap ("gap")."""
        if self.opts.until == "discrete" and sweep >= 1:
            return self.moved
        if self.opts.until == "gap" and sweep >= 1:
            return self.moved or (self.changed and self.closed >= GAP_SHARE)
        return self.changed

    def _recheck(self, ui, last) -> bool:
        """Whether a deferred (stable) unit is re-solved once the rest has converged: always
        (``until="exact"``), or when a class it reads changed discretely since its last solve
        ("discrete", "gap": a rotation's drift alone does not call for it)."""
        if self.opts.until == "exact":
            return True
        used, complete = last[ui]
        return not complete or any(self.discrete_at.get(g, 0) > v for g, v in used.items())

    def _current(self, ui, last) -> bool:
        """Whether unit ``ui`` was solved, completely, from the classes' present elements."""
        if ui not in last:
            return False
        used, complete = last[ui]
        return complete and all(self.versions.get(g, 0) == v for g, v in used.items())

    def _resolve(self, ui, pending, last, stable, sweep):
        self._finish(ui, *self._compute(self.units[ui], pending), last, stable, sweep)

    def _finish(self, ui, record, outcome, last, stable, sweep):
        """Set what unit ``ui``'s solve found (:meth:`_compute`, here or on another process)."""
        ids = self.ids(self.units[ui])
        before = {g: self.versions.get(g, 0) for g in ids}
        self._apply(outcome)
        last[ui] = record
        if sweep > 0 and all(self.versions.get(g, 0) == v for g, v in before.items()):
            stable.add(ui)
        else:
            stable.discard(ui)

    def solve_early(self, ui):
        """Solve unit ``ui`` now, before :meth:`run` (which then takes it as solved in its first
        sweep): for a unit whose similarity reads no other class (activation statistics),
        so that its statistics can be dropped at once."""
        self.presolved[ui] = self._solve(self.units[ui], set())

    def start(self, solved: dict, uis) -> None:
        """Take ``solved`` (group id -> ``(element, SolveResult)``) as the first sweep's solve of
        units ``uis`` (a joint start, see :mod:`.pairs`); the second sweep re-solves them."""
        for gid, (el, res) in solved.items():
            self._set(gid, el, res)
        for ui in uis:
            self.presolved[ui] = ({}, False)

    def _solve(self, unit, pending):
        """Solve one unit and set its elements; returns what it used (see :meth:`_compute`)."""
        record, outcome = self._compute(unit, pending)
        self._apply(outcome)
        return record

    def _compute(self, unit, pending, solve: bool = True):
        """Solve one unit; first sweep: only slots whose other axes are known (fixed or
        already solved). Returns what it used, for the skip test of later sweeps, and what
        :meth:`_apply` sets: None (nothing solved), or ``(seconds, [(group id, element,
        SolveResult)])`` (no elements where the change is negligible). Changes no element;
        ``solve`` False: the similarity only (its caches), no solver call (outcome None)."""
        usable = (lambda dep: not (dep & pending)) if pending else None
        mem = self.solved_groups(unit)
        cross = unit.kind != "single"
        got = [self.similarity(m, cross, usable) for m in mem]
        if usable is not None and not any(x[0] is not None for x in got):
            got = [self.similarity(m, cross) for m in mem]  # nothing clean: B's order for the rest
        scores = getattr(self.feats, "head_scores", {})
        scores = {m.id: scores.pop(m.id) for m in mem if m.id in scores}  # this call's only
        used = set().union(*(x[2] for x in got))
        if self.masses is not None and unit.outer is not None:
            used |= self.masses.deps(unit.outer)  # transport masses read other classes too
        record = ({g: self.versions.get(g, 0) for g in used}, all(x[1] for x in got))
        sims = [(m, x[0]) for m, x in zip(mem, got) if x[0] is not None]
        if not sims or not solve:
            return record, None
        solved = solve_unit(unit, sims, self.opts, self.masses, scores, self.dims_b)
        if self._negligible(unit, sims, solved):
            return record, (sum(res.seconds for _, _, res in solved), [], 0.0)
        progress = self._progress(unit, sims, solved) if self.opts.until == "gap" else None
        return record, (0.0, [(g.id, el, res) for g, el, res in solved], progress)

    def _apply(self, outcome):
        if outcome is None:
            return
        seconds, solved, progress = outcome
        if not solved:
            self.solver_seconds += seconds
        if progress is not None:
            self.closed = max(self.closed, progress)
        for gid, el, res in solved:
            self._set(gid, el, res)

    def _negligible(self, unit, sims, solved) -> bool:
        """Whether the unit's new elements gain at most ``tol`` (relative) on the unit's own
        objective (``Σ <element, S>`` over its classes, heads matched as the outer element
        says) over the elements it had: then the old ones stay and nothing that reads them is
        re-solved. Near-ties (units of nearly equal similarity, rotations moving in the fifth
        digit) would otherwise re-solve every class that reads them, sweep after sweep."""
        if self.opts.tol <= 0:
            return False
        scores = self._scores(unit, sims, solved)
        if scores is None:
            return False
        new_score, old_score = scores
        return new_score - old_score <= self.opts.tol * abs(new_score)

    def _scores(self, unit, sims, solved):
        """``(new, old)``: the unit's objective ``Σ <element, S>`` for the elements just solved
        and for those it had, against the same ``S``; None where they cannot be compared (no
        earlier element, a transport plan, a shape that does not fit)."""
        new = {g.id: el for g, el, _ in solved}
        old = {g.id: self.elements.get(g.id) for g, _, _ in solved}
        if any(e is None or isinstance(e, Map) for e in (*new.values(), *old.values())):
            return None
        new_score, old_score = _unit_score(unit, sims, new), _unit_score(unit, sims, old)
        return None if new_score is None or old_score is None else (new_score, old_score)

    def _progress(self, unit, sims, solved) -> float:
        """The share of its remaining gap that the unit's solve closed: ``(new − old) / (bound −
        old)`` on its own objective ``Σ <element, S>`` (old: the elements it had, against the same
        ``S``), bound by Cauchy–Schwarz (:attr:`~.weights.WeightFeatures.bounds`). A transformed
        copy's nested classes close a large share every sweep until they are exact; two unrelated
        models' rotations drift by a few parts in 10³ of a gap near the whole bound. 1 where it
        cannot tell (no bound, no earlier element, a score that does not fit)."""
        bounds = getattr(self.feats, "bounds", None) or {}
        bound = 0.0
        for g, _ in sims:
            b = bounds.get(g.id)
            if b is None:
                return 1.0
            bound += b
        scores = self._scores(unit, sims, solved)
        if scores is None or bound - scores[1] <= 0:
            return 1.0
        new_score, old_score = scores
        return max(0.0, new_score - old_score) / (bound - old_score)

    def _set(self, gid, el, res):
        if isinstance(el, torch.Tensor) and el.dim() == 2 and is_perm(el):
            el = Perm.from_matrix(el)  # n indices instead of an n×n matrix
            res.element = el
        self.solver_seconds += res.seconds
        if _same(self.elements.get(gid), el):
            return
        self.versions[gid] = self.versions.get(gid, 0) + 1
        self.changed = True
        if _discrete_change(self.elements.get(gid), el):
            self.moved = True
            self.discrete_at[gid] = self.versions[gid]
        self.elements[gid] = el
        self.results[gid] = res


def _unit_score(unit, sims, els):
    """``Σ <element, S>`` of a unit's classes for elements ``els`` (group id -> element): a
    single class; classes fibred over fixed heads (head h with head h); a head family (each B
    head with the A head the outer element matches it to; a class nested deeper, each of its
    B blocks with the A block its outer classes' elements match it to). None where a shape
    does not fit."""
    total = 0.0
    if unit.kind == "single":
        g, S = sims[0]
        return _score(els[g.id], S)
    if unit.kind == "family" and unit.outer.id in els:
        P = els[unit.outer.id]
        if isinstance(P, Perm):
            match = torch.empty_like(P.index)
            match[P.index] = torch.arange(len(P.index), device=P.index.device)
        elif isinstance(P, torch.Tensor) and P.dim() == 2:
            match = P.argmax(0)
        else:
            return None
    else:
        match = None
    for g, S in sims:
        el = els.get(g.id)
        if S.dim() != 4 or not isinstance(el, torch.Tensor):
            return None
        HB = S.shape[1]
        rows = match.to(S.device) if match is not None else torch.arange(HB, device=S.device)
        if len(g.outer) > 1 and unit.kind == "family":
            rows, el = _blocks_match(g, els, match), el.reshape(-1, *el.shape[-2:])
            if rows is None or len(rows) != HB:
                return None
        sub = S[rows, torch.arange(HB, device=S.device)]
        if el.shape != sub.shape:
            return None
        total += float((el.to(S.device, S.dtype) * sub).sum())
    return total


def _blocks_match(g, els, match):
    """B's block -> A's block of a class fibred over several classes (outer to inner), from
    ``match`` (the outermost class's) and the elements of the others (None if one is missing)."""
    for o in g.outer[1:]:
        E = els.get(o)
        if not isinstance(E, torch.Tensor):
            return None
        E = E.reshape(-1, *E.shape[-2:])
        match = torch.arange(E.shape[0], device=E.device) if match is None else match
        if len(match) != E.shape[0]:
            return None
        match = (match.to(E.device)[:, None] * E.shape[-2] + E.argmax(-2)).reshape(-1)
    return match


def _score(el, S):
    """``<el, S>`` for a permutation (index or matrix) or a dense element of ``S``'s shape."""
    if isinstance(el, Perm):
        if S.dim() != 2 or len(el.index) != S.shape[0]:
            return None
        return float(S.gather(1, el.index.to(S.device)[:, None]).sum())
    if not isinstance(el, torch.Tensor) or el.shape != S.shape:
        return None
    return float((el.to(S.device, S.dtype) * S).sum())


def _same(old, new):
    if old is None:
        return False
    if isinstance(old, Perm) or isinstance(new, Perm):
        return (isinstance(old, Perm) and isinstance(new, Perm)
                and torch.equal(old.index, new.index))
    a = old.co if isinstance(old, Map) else old
    b = new.co if isinstance(new, Map) else new
    return a.shape == b.shape and bool(torch.allclose(a, b.to(a.dtype), rtol=0, atol=1e-9))


def _discrete_change(old, new) -> bool:
    """Whether an element's discrete part changed (the element itself did): a permutation's
    order, a head matching, the pattern of a signed or scaled permutation (which coordinate each
    row reads), a transport plan, or its shape or form; a rotation that moves keeps its (dense)
    pattern: not discrete."""
    if old is None or isinstance(old, Perm) or isinstance(new, Perm):
        return not (isinstance(old, Perm) and isinstance(new, Perm) and torch.equal(old.index, new.index))
    if isinstance(old, Map) or isinstance(new, Map):
        return True  # a transport plan between widths: a vertex of its polytope, discrete too
    if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)) or old.shape != new.shape:
        return True
    pa, pb = _pattern(old), _pattern(new)
    if pa is None or pb is None:
        return (pa is None) != (pb is None)  # a monomial map became dense or the reverse
    return not torch.equal(pa, pb.to(pa.device))


def _pattern(E):
    """For a (batch of) matrices with exactly one nonzero per row (permutations, signed or
    scaled): the column each row reads; None for any other (a rotation)."""
    if E.dim() < 2 or int(E.count_nonzero()) != E.numel() // E.shape[-1]:
        return None  # a dense map (a rotation): one reduction, no mask of its size
    nz = E != 0
    if not bool((nz.sum(-1) == 1).all()):
        return None
    return nz.to(torch.uint8).argmax(-1)
