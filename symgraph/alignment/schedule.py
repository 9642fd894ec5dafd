"""Solve units and the order of the first sweep.

A *unit* is what one solver call fills in: a head family (an outer head permutation class and
the classes fibred over it, directly or through one another: expert groups, the experts within
a group, each expert's hidden units; solved jointly by nested matching), classes fibred over
fixed heads (solved per head), or a single class.
"""
from __future__ import annotations

from typing import Any, NamedTuple

from ..core.groups import PERMUTATION_FAMILY, orthogonal_part

__all__ = ["Unit", "units", "first_sweep_order"]


class Unit(NamedTuple):
    kind: str  # "single" | "family" | "fixed-heads"
    outer: Any  # the head Group (family), the Group itself (single), or None (fixed heads)
    members: list  # Groups fibred over ``outer`` (family, fixed heads); [] for a single

    @property
    def deep(self) -> bool:
        """Whether a member is fibred over another member (nested more than one level)."""
        return any(len(m.outer) > 1 for m in self.members)

    def groups(self, selected) -> list:
        """The unit's groups that ``selected(group)`` keeps (the outer class first)."""
        gs = [self.outer] if self.outer is not None else []
        return [g for g in gs + list(self.members) if selected(g)]


def units(report) -> list:
    """The solve units of ``report``'s groups, ordered by their first group's id."""
    groups = report.groups
    families = report.head_families()
    by_outer = {outer: list(members) for outer, members in families if outer is not None}
    for gid in _nested(report, by_outer):  # fibred through a member: joins its family
        by_outer[report.fibre_groups(gid)[0]].append(gid)
    out, done = [], set()
    for g in groups:
        if g.id not in done and g.id in by_outer:
            out.append(Unit("family", g, [groups[m] for m in by_outer[g.id]]))
            done |= {g.id, *by_outer[g.id]}
    for outer, members in families:
        if outer is None and not any(m in done for m in members):
            out.append(Unit("fixed-heads", None, [groups[m] for m in members]))
            done |= set(members)
    for g in groups:
        if g.id not in done:
            out.append(Unit("single", g, []))
            done.add(g.id)
    out.sort(key=lambda u: (u.outer or u.members[0]).id)
    return out


def _nested(report, by_outer) -> list:
    """Ids of the classes fibred over two or more classes, each class of the chain fibred over
    the ones before it (a class's outer classes are its innermost outer class's and that class)
    and the outermost one a family's outer class."""
    ok: dict = {}

    def chained(gid) -> bool:
        if gid not in ok:
            fib = report.fibre_groups(gid)
            ok[gid] = (len(fib) == 1 and fib[0] in by_outer) or (
                len(fib) > 1 and None not in fib and tuple(report.fibre_groups(fib[-1])) == tuple(fib[:-1])
                and chained(fib[-1]))
        return ok[gid]
    return [g.id for g in report.groups if len(report.fibre_groups(g.id)) > 1 and chained(g.id)]


def first_sweep_order(units_, ids_of, solved_groups, feats):
    """Order the first sweep so that each unit is solved when as much of its weight (by
    parameter size) as possible has its other axes known: classes whose features sit on fixed
    axes (the residual stream through the embeddings) go first, then the ones that need them.
    A unit whose known slots cannot determine it goes after every unit whose can: a rotation
    class of n units needs n known columns (a conv's output read only by a head of fewer
    classes, a grouped conv's outputs seen only through their bias), a permutation one.

    ``ids_of(unit)``: the group ids the unit solves; ``solved_groups(unit)``: the groups whose
    similarity it computes; ``feats``: the :class:`~.weights.WeightFeatures` (slots, deps)."""
    pending = set().union(*(ids_of(u) for u in units_)) if units_ else set()
    left, order = list(range(len(units_))), []
    slot_info = {i: [(g, feats.deps(g, n, d), feats.numel(n), _columns(feats, n, d))
                     for g in solved_groups(u) for n, d in feats.slots(g)]
                 for i, u in enumerate(units_)}
    while left:
        def key(i):
            unknown = pending - ids_of(units_[i])
            tot = sum(w for _, _, w, _ in slot_info[i]) or 1
            known = [(g, w, c) for g, dep, w, c in slot_info[i] if not (dep & unknown)]
            cols = {g.id: sum(c for h, _, c in known if h.id == g.id) for g in solved_groups(units_[i])}
            determined = all(cols[g.id] >= (1 if orthogonal_part(g.kind) in PERMUTATION_FAMILY else g.dim)
                             for g in solved_groups(units_[i]))
            return determined, sum(w for _, w, _ in known) / tot, -i
        best = max(left, key=key)
        order.append(best)
        left.remove(best)
        pending -= ids_of(units_[best])
    return order


def _columns(feats, name, d) -> int:
    """How many values slot ``(name, d)`` holds per unit of its axis ``d`` (B's side): at most
    the rank it adds to its class's similarity."""
    rb = feats.rb
    return feats.numel(name) // max(1, rb.axis_size(rb.param_axes(name)[d]))
