"""A joint start for two permutation classes on one axis, neither fibred over the other.

A grouped convolution whose input is its output's own stream (Wav2Vec2's positional
convolution, added back to the residual stream it reads) permutes that stream by ``σ ⊗ π``: its
groups whole (``σ``) and, alike in every group, the channels each holds (``π``). Each class's
similarity reads the other's element on the shared axis, so coordinate descent from nothing
solves one of them from the few slots that do not (the convolution's input channels) and settles
on a wrong pair: a model aligned with its own moved copy came back 64 % off.

The start here solves the pair at once, from the slots whose other axes are fixed: B's features
crossed over the smaller class, ``S[o, o', i, j]`` (block ``o`` of A against block ``o'`` of B),
give each block pair the value of its best inner matching (nested matching's relaxation: one
``π`` per block pair); ``σ`` is the best matching of blocks under those values, ``π`` the best
single inner matching given ``σ``. Both become the descent's start; its later sweeps re-solve
them with every slot.
"""
from __future__ import annotations

import torch
from scipy.optimize import linear_sum_assignment

from ..core.groups import orthogonal_part
from .solve_unit import solve_single

__all__ = ["product_pairs", "start_pairs"]


#: the crossed similarity ``S [k, k, n, n]`` (float64) of a pair at most this many bytes; a larger
#: pair keeps the descent's own start
MAX_BYTES = 256 << 20


def product_pairs(report, units, selected) -> list:
    """``[(unit index of the smaller class, unit index of the larger)]``: two single permutation
    classes that are the only classes of an axis their parameters share, the two factors of its
    coordinates (each one of the other's other leaves there: a product, not two concatenated
    parts), neither fibred, their crossed similarity within :data:`MAX_BYTES`."""
    single = {u.outer.id: i for i, u in enumerate(units)
              if u.kind == "single" and selected(u.outer) and orthogonal_part(u.outer.kind) == "perm"
              and not u.outer.outer}
    found: dict = {}
    for gid, ui in single.items():
        for name, d in dict.fromkeys(report.groups[gid].params):
            axis = report.param_axes(name)[d]
            other = [h for h in report.axis_groups(axis) if h != gid]
            if len(other) != 1 or other[0] not in single or len(report.axis_groups(axis)) != 2 or not any(
                    other[0] in o for o in report.other_leaf_groups(axis, gid)):
                continue
            small, large = sorted((gid, other[0]), key=lambda h: (report.groups[h].dim, h))
            if (report.groups[small].dim * report.groups[large].dim) ** 2 * 8 <= MAX_BYTES:
                found[(small, large)] = (single[small], single[large])
    return sorted(found.values())


def _blocks(report, t, name, d, gid, leaf):
    """Parameter ``t``'s features for class ``gid`` on dim ``d``, per view: ``[k, n, m]`` with
    the ``leaf`` class's coordinates first (``k`` of them), or ``[1, n, m]`` where ``leaf`` is
    not among the view's other leaves."""
    axis = report.param_axes(name)[d]
    moved = report.view(name, t).movedim(d, 0).to(torch.float64)
    out = []
    for (idx, nf), others in zip(report.leaf_views(axis, gid), report.other_leaf_groups(axis, gid)):
        if nf:
            return None
        x = moved[idx.reshape(-1).to(moved.device)].reshape(*idx.shape, *moved.shape[1:])
        x = x.movedim(1 + others.index(leaf), 0) if leaf in others else x[None]
        out.append(x.reshape(x.shape[0], x.shape[1], -1))
    return out


def crossed(feats, small, large):
    """``(S [k, k, n, n], S0 [n, n])``: the larger class's similarity with the smaller one's
    coordinates crossed (A's block against B's), and the part of it from views that do not
    read the smaller class, over the slots whose other axes are fixed. None when no slot is."""
    ra, rb = feats.ra, feats.rb
    k, n = small.dim, large.dim
    S = torch.zeros(k, k, n, n, dtype=torch.float64)
    S0 = torch.zeros(n, n, dtype=torch.float64)
    used = False
    for name, d in dict.fromkeys(large.params):
        if not feats.deps(large, name, d) <= {small.id}:
            continue
        xs_a = _blocks(ra, feats.A[name], name, d, large.id, small.id)
        xs_b = _blocks(rb, feats.B[name], name, d, large.id, small.id)
        if xs_a is None or xs_b is None:
            continue
        for xa, xb in zip(xs_a, xs_b):
            if xa.shape[0] == k and xb.shape[0] == k:
                S += torch.einsum("aim,bjm->abij", xa, xb.to(xa.device)).cpu()
            elif xa.shape[0] == 1 and xb.shape[0] == 1:
                S0 += (xa[0] @ xb[0].to(xa.device).mT).cpu()
            used = True
    return (S, S0) if used else None


def _best_value(s) -> float:
    rows, cols = linear_sum_assignment(s.numpy(), maximize=True)
    return float(s.numpy()[rows, cols].sum())


def start_pairs(run, feats, observed) -> None:
    """Solve each product pair of ``run`` (a :class:`~.sweeps.Sweeps`) jointly from the weights
    and take the result as their solve in its first sweep (re-solved with every slot from the
    second); not a pair of which ``observed(group)`` (activation statistics solve it)."""
    for ui_small, ui_large in product_pairs(feats.ra, run.units, run.opts.selected):
        small, large = run.units[ui_small].outer, run.units[ui_large].outer
        got = None if observed(small) or observed(large) else crossed(feats, small, large)
        if got is None:
            continue
        S, S0 = got
        k = small.dim
        values = torch.tensor([[_best_value(S[o, p]) for p in range(k)] for o in range(k)], dtype=torch.float64)
        res_small, el_small = solve_single(small, values, run.opts, None)
        match = el_small.index if hasattr(el_small, "index") else el_small.argmax(-1)
        inner = S[torch.arange(k), match.cpu()].sum(0) + S0
        res_large, el_large = solve_single(large, inner, run.opts, None)
        run.start({small.id: (el_small, res_small), large.id: (el_large, res_large)}, (ui_small, ui_large))
