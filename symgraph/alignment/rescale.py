"""Seed 003's rescaling, fitted after the rotations: a positive scalar per head of each ``gl``
class (``a·R`` is still in GL, so the model's function is unchanged)."""
from __future__ import annotations

import numpy as np
import torch
from scipy.optimize import minimize_scalar

from ..core.elements import Perm
from .weights import gather

__all__ = ["fit_scales"]


def fit_scales(al, model_a, model_b, groups):
    """Seed 003's rescaling: for each ``gl`` class, per block (head), the scalar ``a > 0``
    minimising ``Σ_co ‖A − a·B'‖² + Σ_contra ‖A − B'/a‖²`` over its slots, where ``B'`` is B
    in A's basis. ``a·E`` is still in GL (co slots scale by ``a``, contra by ``1/a``), so the
    model's function is unchanged. Updates ``al.elements``; returns ``{group id: [a, ...]}``."""
    ra = al.report_a
    targets = [g for g in groups if g.kind == "gl" and isinstance(al.elements.get(g.id), torch.Tensor)]
    if not targets:
        return {}
    Bp = al.state(model_b)
    out = {}
    for g in targets:
        E = al.elements[g.id]
        nblk = int(np.prod(E.shape[:-2])) if E.dim() > 2 else 1
        # E's blocks are indexed by B's heads; the views below by A's: B head of each A head
        fib = [None if f is None else al.elements.get(f) for f in ra.fibre_groups(g.id)]
        if any(not (f is None or isinstance(f, Perm)) for f in fib):
            continue  # heads matched by a soft/rectangular map: no per-head correspondence
        acc = torch.zeros(nblk, 4, dtype=torch.float64)  # co: Σb², Σab; contra: Σb², Σab
        for (name, d), var in zip(g.params, g.variance):
            ax = ra.param_axes(name)
            ta = ra.view(name, model_a.get_parameter(name).detach().double())
            tb = ra.view(name, Bp[name].double())
            for idx, nf in ra.leaf_views(ax[d], g.id):
                xa = gather(ta, d, idx, nf).reshape(nblk, -1)
                xb = gather(tb, d, idx, nf).reshape(nblk, -1)
                k = 0 if var == "co" else 2
                acc[:, k] += (xb * xb).sum(1)
                acc[:, k + 1] += (xa * xb).sum(1)
        acc = acc.reshape(*E.shape[:-2], 4)
        for j, f in enumerate(fib):
            if f is not None:
                acc = acc.index_copy(j, f.index, acc.clone())  # A head i -> B head index[i]
        scales = [_best_scale(*row) for row in acc.reshape(nblk, 4).tolist()]
        sc = torch.tensor(scales, dtype=torch.float64).reshape(*E.shape[:-2], 1, 1)
        al.elements[g.id] = E * sc
        out[g.id] = scales
    return out


def _best_scale(q, c, kk, dd):
    """argmin over a > 0 of q a² − 2c a + kk / a² − 2dd / a (1 unless it beats a = 1)."""
    def f(t):
        return q * np.exp(2 * t) - 2 * c * np.exp(t) + kk * np.exp(-2 * t) - 2 * dd * np.exp(-t)
    r = minimize_scalar(f, bounds=(-6.0, 6.0), method="bounded")
    return float(np.exp(r.x)) if f(r.x) < f(0.0) else 1.0
