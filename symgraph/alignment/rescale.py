"""Seed 003's rescaling, fitted after the rotations: a positive scalar per head of each ``gl``
class (``a·R`` is still in GL, so the model's function is unchanged)."""
from __future__ import annotations

import numpy as np
import torch
from scipy.optimize import minimize_scalar

from ..core.elements import Perm
from .weights import gather

__all__ = ["fit_scales", "fit_gl", "fit_unit_scales"]


def fit_scales(al, model_a, model_b, groups):
    """Seed 003's rescaling: for each ``gl`` class, per block (head), the scalar ``a > 0``
    minimising ``Σ_co ‖A − a·B'‖² + Σ_contra ‖A − B'/a‖²`` over its slots, where ``B'`` is B
    in A's basis. ``a·E`` is still in GL (co slots scale by ``a``, contra by ``1/a``), so the
    model's function is unchanged. Updates ``al.elements``; returns ``{group id: [a, ...]}``."""
    targets = [g for g in groups if g.kind == "gl" and isinstance(al.elements.get(g.id), torch.Tensor)]

    def fit(g, E, Bp):
        nblk = int(np.prod(E.shape[:-2])) if E.dim() > 2 else 1
        fib = head_maps(al, g)  # E's blocks are indexed by B's heads, the views below by A's
        if fib is None:
            return None
        acc = _slot_sums(al.report_a, g, lambda name: model_a.get_parameter(name).detach(), Bp.__getitem__, nblk,
                         E.device)
        acc = _by_b_heads(acc.T.reshape(*E.shape[:-2], 4), fib, 0)
        scales = [_best_scale(*row) for row in acc.reshape(nblk, 4).cpu().tolist()]
        sc = torch.tensor(scales, dtype=torch.float64).to(E.device).reshape(*E.shape[:-2], 1, 1)
        al.elements[g.id] = E * sc
        return scales
    return _each_class(al, targets, lambda: al.state(model_b), fit)


def fit_unit_scales(al, sides, groups) -> dict:
    """The positive scale of each unit of a ``scaled_perm`` class (a ReLU's units: a scale ``s``
    on a unit's inputs is undone by ``1/s`` on its outputs), fitted after the permutation:
    per unit ``argmin_s Σ_co ‖a − s·b′‖² + Σ_contra ‖a − b′/s‖²`` (exact for a transformed
    copy). The element becomes ``diag(s)·P`` (dense: ``n×n``). A slot that another class of
    units not yet fitted also scales (the weight between two ReLU layers of one MLP) is left
    out while the class has a slot without one: the classes are fitted in waves, B moved again
    after each, then once more on all their slots, so a chain of ReLU layers is exact too.
    ``sides``: A's stored tensors and B's in A's basis (:mod:`~.fullgroups`). Updates
    ``al.elements``; returns ``{group id: number of units rescaled}``."""
    targets = [g for g in groups if g.kind == "scaled_perm" and not g.outer
               and isinstance(al.elements.get(g.id), (Perm, torch.Tensor))]
    out: dict = {}
    partial = []  # classes fitted on some of their slots: fitted again on all at the end
    while targets:
        open_ids = {g.id for g in targets}
        slots = {g.id: _clean_slots(al.report_a, g, open_ids) for g in targets}
        now = [g for g in targets if slots[g.id]] or targets  # none has one: all on every slot
        partial += [g for g in now if slots[g.id] and len(slots[g.id]) < len(g.params)]
        out.update(_fit_units(al, sides, now, {g.id: slots[g.id] or None for g in now}))
        targets = [g for g in targets if g not in now]
    if partial:
        out.update(_fit_units(al, sides, partial, {g.id: None for g in partial}))
    return out


def _fit_units(al, sides, classes, slots) -> dict:
    """One fit of the unit scales of ``classes``, each on its ``slots`` (None: all), with B
    moved into A's basis once."""
    def fit(g, E, Bp):
        P = E.dense() if isinstance(E, Perm) else E.double()
        if P.dim() != 2 or P.shape[0] != P.shape[1]:
            return None
        sums = _slot_sums(al.report_a, g, sides.anchor, Bp.__getitem__, P.shape[0], P.device, slots[g.id])
        scales = _best_scales(*sums)
        al.elements[g.id] = scales[:, None] * P
        return int((scales != 1).sum())
    return _each_class(al, classes, lambda: sides.moved(al), fit)


def _clean_slots(ra, g, open_ids) -> list:
    """The slots of class ``g`` whose tensors no other class of ``open_ids`` also maps."""
    keep = []
    for name, d in g.params:
        ax = ra.param_axes(name)
        others = {i for k, a in enumerate(ax) if k != d for i in ra.axis_groups(a)}
        if not others & (open_ids - {g.id}):
            keep.append((name, d))
    return keep


def _each_class(al, targets, moved, fit) -> dict:
    """``{group id: fit(group, its element, B in A's basis)}`` over the ``targets`` that ``fit``
    does not pass over (None), with B moved into A's basis once (``moved()``), and only when
    there is a target."""
    if not targets:
        return {}
    Bp = moved()
    out = {}
    for g in targets:
        got = fit(g, al.elements[g.id], Bp)
        if got is not None:
            out[g.id] = got
    return out


def _slot_sums(ra, g, a_of, b_of, rows, device, slots=None):
    """``[4, rows]`` float64 sums over the slots of class ``g``, per block (a ``gl`` class's
    heads) or unit: ``Σ b²``, ``Σ a·b`` over its co occurrences, then over its contra ones, of A's
    tensors (``a_of(name)``) and B's in A's basis (``b_of(name)``). Each occurrence counts on its
    own side: a packed projection (GPT-2's c_attn) holds a class's Q (co) and K (contra) leaves
    in one slot. ``slots``: only these of ``g.params`` (default: all)."""
    acc = torch.zeros(4, rows, dtype=torch.float64, device=device)
    for name, d in (g.params if slots is None else slots):
        ax = ra.param_axes(name)
        ta = ra.view(name, a_of(name).double())
        tb = ra.view(name, b_of(name).double())
        for idx, nf, parity in ra.leaf_views(ax[d], g.id, with_parity=True):
            xa = gather(ta, d, idx, nf).reshape(rows, -1)
            xb = gather(tb, d, idx, nf).reshape(rows, -1)
            acc[2 * parity] += (xb * xb).sum(1)
            acc[2 * parity + 1] += (xa * xb).sum(1)
    return acc


def _best_scales(q, c, kk, dd, iters: int = 80):
    """:func:`_best_scale` for many units at once: golden-section search over ``log a`` in
    [-6, 6] (the objective is unimodal in ``log a``), kept where it beats ``a = 1``."""
    def f(t):
        return q * torch.exp(2 * t) - 2 * c * torch.exp(t) + kk * torch.exp(-2 * t) - 2 * dd * torch.exp(-t)
    lo, hi = torch.full_like(q, -6.0), torch.full_like(q, 6.0)
    r = (5 ** 0.5 - 1) / 2
    for _ in range(iters):
        m1, m2 = hi - r * (hi - lo), lo + r * (hi - lo)
        left = f(m1) < f(m2)
        hi, lo = torch.where(left, m2, hi), torch.where(left, lo, m1)
    t = (lo + hi) / 2
    return torch.where(f(t) < f(torch.zeros_like(t)), torch.exp(t), torch.ones_like(t))


def head_maps(al, g):
    """The element of each class ``g`` is fibred over (None for a fixed one), or None when
    heads were matched by a soft or rectangular map (no per-head correspondence)."""
    fib = [None if f is None else al.elements.get(f) for f in al.report_a.fibre_groups(g.id)]
    return None if any(not (f is None or isinstance(f, Perm)) for f in fib) else fib


def _by_b_heads(acc, fib, lead: int):
    """Statistics indexed by A's heads (dims ``lead..``) re-indexed by B's, as the element's
    blocks are: A head i -> B head index[i]."""
    for j, f in enumerate(fib):
        if f is not None:
            acc = acc.index_copy(lead + j, f.index, acc.clone())
    return acc


def _best_scale(q, c, kk, dd):
    """argmin over a > 0 of q a² − 2c a + kk / a² − 2dd / a (1 unless it beats a = 1)."""
    def f(t):
        return q * np.exp(2 * t) - 2 * c * np.exp(t) + kk * np.exp(-2 * t) - 2 * dd * np.exp(-t)
    r = minimize_scalar(f, bounds=(-6.0, 6.0), method="bounded")
    return float(np.exp(r.x)) if f(r.x) < f(0.0) else 1.0


def fit_gl(al, sides, groups) -> dict:
    """The full groups the report claims, after their orthogonal part is solved: for each
    ``gl`` class, per block (head), the matrix ``G`` for which ``G·E`` (``E`` the solved
    element) brings B closest to A over the class's slots, ``Σ_co ‖X_A − G·X_B′‖² +
    Σ_contra ‖Y_A − G⁻ᵀ·Y_B′‖²``; for each ``rope`` class, per RoPE pair, the scalar of its
    scaled rotation. The candidates are the identity (the orthogonal solve), the least-squares
    fit of the co slots and that of the contra slots; the best is kept. Every candidate is in
    the group, so B's function is unchanged whatever is chosen; for a transformed copy the
    least-squares fits are exact. ``sides``: as :func:`fit_unit_scales`. Updates
    ``al.elements``; returns ``{group id: kept}`` with kept one of ``"orthogonal"``, ``"co"``,
    ``"contra"`` per block (``"pairs"`` for RoPE)."""
    ra = al.report_a
    targets = [g for g in groups if g.kind in ("gl", "rope") and isinstance(al.elements.get(g.id), torch.Tensor)
               and al.elements[g.id].dim() >= 2 and al.elements[g.id].shape[-1] == al.elements[g.id].shape[-2]]

    def fit(g, E, Bp):
        n = E.shape[-1]
        nblk = int(np.prod(E.shape[:-2])) if E.dim() > 2 else 1
        fib = head_maps(al, g)
        if fib is None:
            return None
        acc = torch.zeros(2, 2, nblk, n, n, dtype=torch.float64, device=E.device)  # [co/contra][XaXbᵀ, XbXbᵀ]
        for name, d in dict.fromkeys(g.params):  # a packed slot (q and k in one) is listed twice
            ax = ra.param_axes(name)
            ta = ra.view(name, sides.anchor(name).double())
            tb = ra.view(name, Bp[name].double())
            for idx, nf, k in ra.leaf_views(ax[d], g.id, with_parity=True):
                xa = gather(ta, d, idx, nf).reshape(nblk, n, -1)
                xb = gather(tb, d, idx, nf).reshape(nblk, n, -1)
                acc[k, 0] += xa @ xb.mT
                acc[k, 1] += xb @ xb.mT
        acc = _by_b_heads(acc.reshape(2, 2, *E.shape[:-2], n, n), fib, 2).reshape(2, 2, nblk, n, n)
        G, kept = (_pair_scales if g.kind == "rope" else _best_gl)(acc, g)
        al.elements[g.id] = (G.reshape(E.shape).to(E.dtype) @ E)
        return kept
    return _each_class(al, targets, lambda: sides.moved(al), fit)


def _objective(G, acc):
    """``Σ_co ‖X_A − G X_B′‖² + Σ_contra ‖Y_A − G⁻ᵀ Y_B′‖²`` up to a constant, per block."""
    H = torch.linalg.inv(G).mT
    (cax, cxx), (cay, cyy) = acc
    f = -2 * (G * cax).sum((-1, -2)) + (G @ cxx * G).sum((-1, -2))
    return f - 2 * (H * cay).sum((-1, -2)) + (H @ cyy * H).sum((-1, -2))


def _solve_ls(c, s):
    """``c s⁻¹`` per block where ``s`` is well conditioned, else None for that block."""
    ok = torch.linalg.cond(s) < 1e10
    sol = torch.linalg.lstsq(s.mT, c.mT).solution.mT  # X s = c  <=>  sᵀ Xᵀ = cᵀ
    return sol, ok


def _best_gl(acc, g):
    nblk, n = acc.shape[2], acc.shape[-1]
    eye = torch.eye(n, dtype=torch.float64, device=acc.device).expand(nblk, n, n)
    cands, oks = [eye], [torch.ones(nblk, dtype=torch.bool, device=acc.device)]
    co, ok = _solve_ls(acc[0, 0], acc[0, 1])
    cands.append(co)
    oks.append(ok & (torch.linalg.cond(co) < 1e8))
    h, ok = _solve_ls(acc[1, 0], acc[1, 1])
    good = ok & (torch.linalg.cond(h) < 1e8)
    cands.append(torch.linalg.inv(torch.where(good[:, None, None], h, eye)).mT)  # the identity where not good
    oks.append(good)
    best, kept = eye.clone(), []
    fs = torch.stack([torch.where(o, _objective(torch.where(o[:, None, None], c, eye), acc), torch.inf)
                      for c, o in zip(cands, oks)])
    pick = fs.argmin(0)
    for b in range(nblk):
        best[b] = cands[int(pick[b])][b]
        kept.append(("orthogonal", "co", "contra")[int(pick[b])])
    return best, kept


def _pair_scales(acc, g):
    """Per RoPE pair, the scalar of its scaled rotation (pairs ``g.pairs``)."""
    nblk, n = acc.shape[2], acc.shape[-1]
    d = torch.diagonal(acc, dim1=-2, dim2=-1)  # [2, 2, nblk, n]: per coordinate <a, b>, |b|²
    scale = torch.ones(nblk, n, dtype=torch.float64, device=acc.device)
    for p in g.pairs or ():
        p = torch.tensor(list(p)).to(acc.device)  # an index tensor on the device (a list is copied per use)
        c, q = d[0, 0][:, p].sum(-1), d[0, 1][:, p].sum(-1)
        dd, kk = d[1, 0][:, p].sum(-1), d[1, 1][:, p].sum(-1)
        for b in range(nblk):
            f = lambda a, b=b: float(q[b] * a * a - 2 * c[b] * a + kk[b] / (a * a) - 2 * dd[b] / a)  # noqa: E731
            cands = [1.0] + [x for x in (float(c[b] / q[b]) if q[b] > 0 else 0.0,
                                         float(kk[b] / dd[b]) if dd[b] > 0 else 0.0) if x > 0]
            scale[b, p] = min(cands, key=f)
    return torch.diag_embed(scale), "pairs"
