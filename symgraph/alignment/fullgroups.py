"""Fitting the full groups after the orthogonal parts are solved (``full_groups=True``): each
scaled permutation's unit scales, each head's GL map and RoPE's pair scales
(:mod:`~symgraph.alignment.rescale`), alternated with re-solving the continuous classes.

What the fit reads of the two models comes through a *sides* object, so that it runs on loaded
models (:class:`ModelSides`) and out of core (:class:`symgraph.merging.views.Sides`, the
checkpoints read on demand) with the same numbers:

- ``anchor(name)``: A's stored parameter (norm gains not folded);
- ``moved(al)``: ``{name: tensor}`` (any object with ``[name]``) of B carried into A's basis
  by ``al``'s elements of the moment, what :meth:`Alignment.state` gives;
- ``features(ra, rb)``: a :class:`~.weights.WeightFeatures` of the two models' folded weights
  (float64 rotations, exact products);
- ``release()``: drop what it holds.
"""
from __future__ import annotations

import torch

from ..core.groups import PERMUTATION_FAMILY, orthogonal_part
from .rescale import _head_maps, fit_gl, fit_unit_scales
from .solve_unit import _solve_single
from .weights import WeightFeatures

__all__ = ["ModelSides", "fit_full_groups"]


class ModelSides:
    """The sides of loaded models: their parameters, :meth:`Alignment.state` of B."""

    def __init__(self, model_a, model_b):
        self.model_a, self.model_b = model_a, model_b

    def anchor(self, name):
        return self.model_a.get_parameter(name).detach()

    def moved(self, al):
        return al.state(self.model_b)

    def features(self, ra, rb):
        return WeightFeatures.from_models(ra, rb, self.model_a, self.model_b)

    def release(self):
        pass


def fit_full_groups(al, sides, opts, rounds: int = 16, tol: float = 1e-10) -> dict:
    """:func:`fit_unit_scales` and :func:`fit_gl`, alternated with re-solving the continuous
    classes against the fitted heads (residual streams, whose similarity reads the heads'
    maps, and the heads' orthogonal parts, e.g. RoPE rotations, which read the streams): each
    solved against the other's orthogonal-only solution is off where the maps are not
    orthogonal. Alternates until no element moves by more than ``tol`` (at most ``rounds``;
    a transformed copy takes about 8). ``sides``: what it reads of the models (see the module
    docstring), released at the end."""
    try:
        return _fit(al, sides, opts, rounds, tol)
    finally:
        sides.release()


def _fit(al, sides, opts, rounds, tol) -> dict:
    ra, rb = al.report_a, al.report_b
    sel = [g for g in ra.groups if opts.selected(g)]
    units = fit_unit_scales(al, sides, sel)  # scaled permutations: exact after the permutation
    kept = fit_gl(al, sides, sel)
    scaled = {gid: f"{n} unit scales" for gid, n in units.items()}
    free = [g for g in sel if not g.outer and g.kind not in ("gl", "rope") and isinstance(al.elements.get(g.id), torch.Tensor)
            and orthogonal_part(g.kind) not in PERMUTATION_FAMILY]
    if not kept or not free:
        return {**kept, **scaled}
    feats = sides.features(ra, rb)
    b_of = dict(zip((g.id for g in ra.groups), rb.groups))
    members = [g for g in sel if g.outer and g.id in kept and isinstance(al.elements.get(g.id), torch.Tensor)]
    watched = [g.id for g in free + members]
    try:
        for _ in range(rounds):
            before = {gid: al.elements[gid].clone() for gid in watched if isinstance(al.elements.get(gid), torch.Tensor)}
            for gid in kept:
                feats.versions[gid] = feats.versions.get(gid, 0) + 1  # their elements changed
            for g in free:
                sim, _, _ = feats.similarity(g, b_of[g.id], al.elements, False)
                if sim is not None:
                    al.elements[g.id] = _solve_single(g, sim, opts, lambda _g: None)[1]
                    feats.versions[g.id] = feats.versions.get(g.id, 0) + 1
            for g in members:  # the heads' orthogonal parts (RoPE rotations) again, against the new streams
                el = _resolve_member(al, g, feats, b_of[g.id], opts)
                if el is not None:
                    al.elements[g.id] = el
                    feats.versions[g.id] = feats.versions.get(g.id, 0) + 1
            kept = fit_gl(al, sides, sel)
            if all(al.elements[g].shape == E.shape and float((al.elements[g] - E).abs().max()) <= tol
                   for g, E in before.items()):
                break
    finally:
        feats.release()
    return {**kept, **scaled}


def _resolve_member(al, g, feats, gb, opts):
    """The orthogonal part of a head class ``g`` (fibred over one head class whose heads were
    matched by a permutation) solved again per matched head pair; None otherwise."""
    fib = _head_maps(al, g)
    E = al.elements[g.id]
    if fib is None or len(fib) != 1 or E.dim() != 3:
        return None
    sim, _, _ = feats.similarity(g, gb, al.elements, True)  # [H_A, H_B, n, n]
    if sim is None or sim.dim() != 4:
        return None
    hb = torch.arange(sim.shape[1], device=sim.device)
    if fib[0] is None:
        ha = hb
    else:  # E is indexed by B's heads: B head index[i] is A head i
        ha = torch.empty_like(fib[0].index).to(sim.device)
        ha[fib[0].index.to(sim.device)] = torch.arange(len(ha), device=sim.device)
    _, el = _solve_single(g, sim[ha, hb], opts, lambda _g: None)
    if not isinstance(el, torch.Tensor) or el.shape != E.shape:
        return None
    return el.to(E.dtype)
