"""Evaluating merges: losses along the linear path between two models, and the loss barrier."""
from __future__ import annotations

import copy

import numpy as np
import torch

from ..errors import InputError

__all__ = ["interpolate", "loss_barrier"]


def interpolate(a, b, lambdas=None, loss_fn=None, attention: str = "heads"):
    """Losses along ``λθ_A + (1−λ)θ_B``; returns ``[(λ, loss), ...]`` (21 points by default).

    ``attention="circuits"``: along the circuit-space line instead (Theus et al. 2025): every
    head computes ``λ·QK_A + (1−λ)·QK_B`` and ``λ·OV_A + (1−λ)·OV_B``
    (:func:`symgraph.merging.circuits.circuit_merge`); the end points are A and B."""
    if loss_fn is None:
        raise InputError("interpolate needs loss_fn(model) -> float")
    lambdas = np.linspace(0, 1, 21) if lambdas is None else lambdas
    if attention not in ("heads", "circuits"):
        raise InputError(f"attention={attention!r}; expected 'heads' or 'circuits'")
    pa = dict(a.named_parameters())
    pb = dict(b.named_parameters())
    for k in pa:
        if k not in pb or pa[k].shape != pb[k].shape:
            raise InputError(f"models differ at parameter {k!r}; interpolate needs equal shapes")
    if attention == "circuits":
        from ..report import analyze
        from .circuits import circuit_merge
        rep = analyze(a)
        return [(float(lam), float(loss_fn(circuit_merge([a, b], [lam, 1 - lam], rep)))) for lam in lambdas]
    m = copy.deepcopy(a)
    curve = []
    for lam in lambdas:
        with torch.no_grad():
            for k, p in m.named_parameters():
                p.copy_(lam * pa[k] + (1 - lam) * pb[k])
        curve.append((float(lam), float(loss_fn(m))))
    return curve


def loss_barrier(curve) -> float:
    """``max_λ L(λ) − ½(L(θ_A) + L(θ_B))`` (Verma & Elbayad 2024), with θ_A at λ=1 and θ_B at λ=0."""
    curve = sorted(curve)
    if len(curve) < 2:
        raise InputError("loss_barrier needs at least the two end points")
    lo, hi = curve[0][1], curve[-1][1]
    return max(l for _, l in curve) - 0.5 * (lo + hi)
