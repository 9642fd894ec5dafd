"""Fitting the full groups after the orthogonal parts are solved (``full_groups=True``): each
scaled permutation's unit scales, each head's GL map and RoPE's pair scales
(:mod:`~symgraph.alignment.rescale`), alternated with re-solving the continuous classes.

What the fit reads of the two models comes through a *sides* object, so that it runs on loaded
models (:class:`ModelSides`) and out of core (:class:`symgraph.merging.engine.views.Sides`, the
checkpoints read on demand) with the same numbers:

- ``anchor(name)``: A's stored parameter (norm gains not folded);
- ``moved(al)``: ``{name: tensor}`` (any object with ``[name]``) of B carried into A's basis
  by ``al``'s elements of the moment, what :meth:`Alignment.state` gives;
- ``features(ra, rb)``: a :class:`~.weights.WeightFeatures` of the two models' folded weights
  (float64 rotations, exact products);
- ``release()``: drop what it holds.

The unit scales are fitted on the stored weights (``anchor``, ``moved``). The heads' full maps
and RoPE's pair scales are fitted on the folded weights (each model's norm gains folded into
their readers: the features' tensors, :class:`_Folded`), the space the continuous classes are
solved in, so that the alternation serves one objective: fitted on the stored weights, a
coordinate behind a small gain (DeepSeek-V3's ``kv_a_layernorm``: 8e-4) weighs ``1/gain²`` times
more in the fit than in the rotation's solve, and the two pull against each other (the fit
stopped 0.37 off on a transformed copy).
"""
from __future__ import annotations

import torch

from ..core.groups import PERMUTATION_FAMILY, orthogonal_part
from ..transform.apply import map_parameters
from .rescale import head_maps, fit_gl, fit_unit_scales
from .solve_unit import solve_single
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
    orthogonal. The first round re-solves each continuous class from the slots that read no
    head map where they determine it (:func:`_clean_pass`): a transformed copy is then exact
    after it, and the second round confirms it. Alternates until no element moves by more than
    ``tol``, or, for weights stored in less than float64, by more than their precision allows
    (``8·eps``, at most 1e-6: the candidate fits of a head then trade places in the last
    digits, round after round), at most ``rounds`` times. ``sides``: what it reads of the
    models (see the module docstring), released at the end."""
    try:
        return _fit(al, sides, opts, rounds, tol)
    finally:
        sides.release()


def _fit(al, sides, opts, rounds, tol) -> dict:
    ra, rb = al.report_a, al.report_b
    sel = [g for g in ra.groups if opts.selected(g)]
    units = fit_unit_scales(al, sides, sel)  # scaled permutations: exact after the permutation
    scaled = {gid: f"{n} unit scales" for gid, n in units.items()}
    if not any(g.kind in ("gl", "rope") for g in sel):
        return scaled
    feats = sides.features(ra, rb)
    try:
        return {**_alternate(al, feats, sel, opts, rounds, tol), **scaled}
    finally:
        feats.release()


def _alternate(al, feats, sel, opts, rounds, tol) -> dict:
    """:func:`fit_gl` on the folded weights, alternated with re-solving the continuous classes
    not fibred over heads (residual streams, latent spaces, a RoPE rotation shared by every
    head) and the heads' orthogonal parts; returns what the last :func:`fit_gl` kept."""
    folded = _Folded(feats, al.report_b)
    kept = fit_gl(al, folded, sel)
    free = [g for g in sel if not g.outer and g.kind != "gl" and isinstance(al.elements.get(g.id), torch.Tensor)
            and orthogonal_part(g.kind) not in PERMUTATION_FAMILY]
    if not kept or not free:
        return kept
    b_of = dict(zip((g.id for g in al.report_a.groups), al.report_b.groups))
    members = [g for g in sel if g.outer and g.id in kept and isinstance(al.elements.get(g.id), torch.Tensor)]
    watched = [g.id for g in free + members]
    tol = max(tol, min(8 * _eps(feats, kept), 1e-6))
    for r in range(rounds):
        before = {gid: al.elements[gid].clone() for gid in watched if isinstance(al.elements.get(gid), torch.Tensor)}
        for gid in kept:
            feats.versions[gid] = feats.versions.get(gid, 0) + 1  # their elements changed
        done = _clean_pass(al, feats, free, b_of, opts) if r == 0 else set()
        for g in free:  # a RoPE class's rotation too: its pair scales are fitted again below
            if g.id in done:
                continue
            sim, _, _ = feats.similarity(g, b_of[g.id], al.elements, False)
            if sim is not None:
                al.elements[g.id] = solve_single(g, sim, opts, lambda _g: None)[1]
                feats.versions[g.id] = feats.versions.get(g.id, 0) + 1
        for g in members:  # the heads' orthogonal parts (RoPE rotations) again, against the new streams
            el = _resolve_member(al, g, feats, b_of[g.id], opts)
            if el is not None:
                al.elements[g.id] = el
                feats.versions[g.id] = feats.versions.get(g.id, 0) + 1
        kept = fit_gl(al, folded, sel)
        if all(al.elements[g].shape == E.shape and float((al.elements[g] - E).abs().max()) <= tol
               for g, E in before.items()):
            break
    return kept


def _clean_pass(al, feats, free, b_of, opts) -> set:
    """Re-solve the classes ``free`` from their *clean* slots first: those that read no head
    map (a ``gl`` class: its orthogonal solution is off until its own neighbours are right)
    and no class of ``free`` still waiting, each class as soon as its clean slots determine it
    (its similarity well conditioned), until none is left that they do. For a transformed copy
    each is then exact, and so are the maps fitted from them: the alternation starts at the
    answer (from the orthogonal solutions, a latent space read by a head map and the head map
    read by it converge slowly, at 0.5 a round on DeepSeek-V3's latent attention). Returns
    the ids solved."""
    waiting = {g.id for g in free}
    maps = {g.id for g in al.report_b.groups if g.kind == "gl"}
    while True:
        solved = set()
        for g in free:
            if g.id not in waiting:
                continue
            block = maps | (waiting - {g.id})
            clean: dict = {}  # a slot's dependencies (as the features name them) -> whether clean
            for name, d in feats.slots(g):
                dep = feats.deps(b_of[g.id], name, d)
                clean[dep] = clean.get(dep, True) and not _reads(al.report_b, b_of[g.id], name, d) & block
            sim, _, _ = feats.similarity(g, b_of[g.id], al.elements, False, lambda dep: clean.get(dep, False))
            if sim is None or sim.dim() != 2 or sim.shape[0] != sim.shape[1]:
                continue
            sv = torch.linalg.svdvals(sim.double())
            if float(sv[-1]) <= 1e-6 * float(sv[0]):
                continue  # its clean slots leave it undetermined
            al.elements[g.id] = solve_single(g, sim, opts, lambda _g: None)[1]
            feats.versions[g.id] = feats.versions.get(g.id, 0) + 1
            waiting.discard(g.id)
            solved.add(g.id)
        if not solved:
            return {g.id for g in free} - waiting


def _reads(rb, gb, name, d) -> set:
    """The classes whose elements class ``gb``'s slot ``(name, d)`` reads: every class on the
    parameter's other axes, and on axis ``d`` the other leaves of ``gb``'s own views (not the
    classes of the axis' other parts: a latent space concatenated with a RoPE key)."""
    ax = rb.param_axes(name)
    out = {x for k, a in enumerate(ax) if k != d for x in rb.axis_groups(a)}
    out.update(x for o in rb.other_leaf_groups(ax[d], gb.id) for x in o if x is not None)
    return out


def _eps(feats, gids) -> float:
    """The machine epsilon of the weights the classes ``gids`` act on (A's, of the first slot)."""
    g = next(g for g in feats.ra.groups if g.id in gids)
    t = feats.A[g.params[0][0]]
    return float(torch.finfo(t.dtype).eps) if t.is_floating_point() else 0.0


class _Folded:
    """The sides :func:`fit_gl` reads, from ``feats``' folded weights: ``anchor(name)``, A's;
    ``moved(al)``, B's carried into A's basis by the elements ``al`` has now (each tensor on
    demand, in float64), what the continuous classes' similarities read."""

    def __init__(self, feats, rb):
        self.feats, self.rb = feats, rb

    def anchor(self, name):
        return self.feats.A[name]

    def moved(self, al):
        return _Moved(self.feats.B, self.rb, dict(al.elements))


class _Moved:
    def __init__(self, tensors, rb, elements):
        self.tensors, self.rb, self.elements = tensors, rb, elements

    def __getitem__(self, name):
        t = self.tensors[name]
        return map_parameters(self.rb, self.elements, {name: t}).get(name, t)


def _resolve_member(al, g, feats, gb, opts):
    """The orthogonal part of a head class ``g`` (fibred over one head class whose heads were
    matched by a permutation) solved again per matched head pair; None otherwise."""
    fib = head_maps(al, g)
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
    _, el = solve_single(g, sim[ha, hb], opts, lambda _g: None)
    if not isinstance(el, torch.Tensor) or el.shape != E.shape:
        return None
    return el.to(E.dtype)
