"""Unit masses for transport between classes of different widths (the marginals of the OT).

A unit's mass is what it contributes downstream: the norm of its *contravariant* slices (the
weights that read it, where a transport map sums B's units into A's: an MLP unit's outgoing
column, a head's output-projection block), times the unit's activation RMS where activation
statistics observed the class. A function-preserving widening copies a unit k times with the
same incoming weights and splits its outgoing weights ``w`` into ``α_1 w, …, α_k w`` with
``α_i ≥ 0`` summing to 1: the copies' masses then sum to the original unit's, so the exact
transport sends each copy wholly to its original and the map (rows averaged, columns summed)
undoes the widening exactly. Uniform masses give a unit copied three times the mass of one,
and the plan must spill the surplus onto other units.

Uniform masses remain where a class has no contravariant slot, for classes fibred over heads
(solved per head) and for splits of mixed sign (a copy with ``α < 0`` counts ``|α|``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, get_args

import torch

from ..core.elements import apply_along
from .weights import gather

__all__ = ["MASSES", "Masses", "slices", "unit_masses", "mass_function", "MassFunction"]

#: How a transport weighs the units (``AlignOptions.masses``).
Masses = Literal["auto", "weights", "activations", "uniform"]
MASSES: tuple[str, ...] = get_args(Masses)


def slices(report, tensors, group, variance: str, axis_op=None):
    """The ``[n, m]`` float64 slices of an unfibred class's units in its ``variance`` ("co" or
    "contra") slots of ``tensors``, one per slot and view. ``axis_op(axis)``: the current map
    of another axis into the reference basis (applied first), or None."""
    for (name, d), var in dict(zip(group.params, group.variance)).items():
        if var != variance:
            continue
        axes = report.param_axes(name)
        t = report.view(name, tensors[name])
        for k, a in enumerate(axes):
            M = axis_op(a) if (axis_op is not None and k != d) else None
            if M is not None:
                t = apply_along(t, k, M)
        for idx, nf in report.leaf_views(axes[d], group.id):
            if not nf:
                yield gather(t, d, idx, nf).to(torch.float64)


def unit_masses(report, tensors, group, act_rms=None, axis_op=None):
    """``[n]`` masses of an unfibred class of ``report`` from its contravariant slices of
    ``tensors`` (norm gains folded), times ``act_rms [n]`` when given; None when the class is
    fibred or has no contravariant slot. ``axis_op(axis)``: the current map of another axis
    into the reference basis (model B's slices are measured in A's coordinates: a widened
    reader's rows are averaged back before the norm is taken), or None."""
    if group.outer:
        return None
    sq = [(x * x).sum(-1) for x in slices(report, tensors, group, "contra", axis_op)]
    if not sq:
        return None
    m = sum(sq).sqrt()
    if act_rms is not None and act_rms.shape == m.shape:
        m = m * act_rms.to(m)
    return m


@dataclass(frozen=True)
class MassFunction:
    """``f(group_a)``: the masses of :func:`mass_function`; ``f.deps(group_a)``: B's classes they read."""
    masses: Callable
    deps: Callable

    def __call__(self, ga):
        return self.masses(ga)


def mass_function(feats, b_of, mode: str = "auto", stats=None, elements=None):
    """``f(group_a) -> (a, b) | None``: the masses of A's and B's units of a class (None:
    uniform); ``f.deps(group_a)``: B's classes those masses read (the solve loop re-solves the
    class when one of them changes). ``mode``: "weights" (contributions from weight norms), "activations"
    (weights times activation RMS where ``stats`` observed the class, weights elsewhere),
    "uniform", or "auto" (activations when given, else weights, used only between
    different widths: between equal widths the exact plan stays a permutation).
    ``elements``: the solve loop's current elements (B's other axes are mapped by them)."""
    def rms(st, which):
        if st is None or st.n == 0:
            return None
        sq = st.saa if which == "a" else st.sbb
        return (sq.reshape(-1, sq.shape[-1])[0] / st.n).clamp_min(0).sqrt() if sq.shape[0] == 1 else None

    def used(ga) -> bool:
        return mode != "uniform" and (mode != "auto" or ga.size != b_of[ga.id].size)

    def fn(ga):
        if not used(ga):
            return None
        gb = b_of[ga.id]
        st = stats.get(ga.id) if (stats is not None and mode in ("auto", "activations")) else None
        ma = unit_masses(feats.ra, feats.A, ga, rms(st, "a"))
        op = (lambda a: feats._axis_op(a, elements)) if elements is not None else None
        mb = unit_masses(feats.rb, feats.B, gb, rms(st, "b"), op)
        return None if ma is None or mb is None else (ma, mb)

    def deps(ga) -> frozenset:
        if not used(ga) or ga.outer:
            return frozenset()
        gb = b_of[ga.id]
        return frozenset().union(*(feats.deps(gb, name, d) for (name, d), var
                                   in zip(gb.params, gb.variance) if var == "contra"))
    return MassFunction(fn, deps)
