"""Solving one unit from its similarity matrices: a single class, classes fibred over fixed
heads (per head), or a head family (nested matching: an outer assignment of heads whose cost
is each head pair's best inner alignment; for classes nested deeper, each level's block pairs
scored by its own similarity plus the best matches of the classes nested under it)."""
from __future__ import annotations

import torch

from .. import solve as S
from ..core.elements import Map, is_perm
from ..core.groups import orthogonal_part

__all__ = ["solve_unit"]


def solve_unit(unit, sims, opts, masses=None, scores=None, dims_b=None) -> list:
    """``[(group, element, SolveResult)]`` for ``unit`` given ``sims``: ``[(group, S)]`` for the
    groups whose similarity is known (the members; the class itself for a single).
    ``masses(group)``: the units' masses ``(a, b)`` for a transport, or None (uniform; see
    :mod:`~.masses`). ``scores``: ``{group id: [H_A, H_B]}`` head-pair scores that replace a
    member's inner objective in the outer matching (circuit distances). ``dims_b``: ``{group
    id: B's per-block size}`` (A's where not given), for a family nested more than one level."""
    masses = masses or (lambda g: None)
    if unit.kind == "single":
        g, s = sims[0]
        res, el = solve_single(g, s, opts, masses)
        return [(g, el, res)]
    if unit.deep:
        return _solve_tree(unit, sims, opts, masses, scores or {}, dims_b or {})
    if unit.kind == "fixed-heads" or not opts.selected(unit.outer):
        # heads kept in index order (no head class, or not selected): per-head inner solve
        out = []
        for m, s in sims:
            diag = torch.stack([s[h, h] for h in range(s.shape[0])])
            res = S.inner_blocks(orthogonal_part(m.kind), diag, m.pairs, opts.inner)
            out.append((m, element_from(res), res))
        return out
    kinds = [orthogonal_part(m.kind) for m, _ in sims]
    HA, HB = sims[0][1].shape[:2]
    out_res, inner_els = S.nested_heads(
        [s for _, s in sims], kinds, [m.pairs for m, _ in sims], inner=opts.inner,
        outer="hungarian" if opts.solver not in ("ot", "sinkhorn") else "ot",
        masses=masses(unit.outer), scores=[(scores or {}).get(m.id) for m, _ in sims])
    match = out_res.element.argmax(0).to(sims[0][1].device)
    out = [(unit.outer, element_from(out_res), out_res)]
    for (m, s), el in zip(sims, inner_els):
        nA, nB = s.shape[-2:]
        obj = float((el * s[match, torch.arange(HB, device=s.device)]).sum())
        res = S.SolveResult(el, obj, extra={"plan": nA != nB})
        out.append((m, element_from(res), res))
    return out


def _solve_tree(unit, sims, opts, masses, scores, dims_b):
    """A family nested more than one level (:func:`~symgraph.solve.nested_tree`): each member
    is matched block by block as its outer classes are, and scores its outer class's block
    pairs by its own similarity plus its inner members' best matches."""
    got = dict((m.id, s) for m, s in sims)
    root = unit.outer.id
    members = [m for m in unit.members if opts.selected(m)]
    ids = {root} | {m.id for m in members}
    members = [m for m in members if all(o in ids for o in m.outer)]  # its chain selected
    index = {m.id: i for i, m in enumerate(members)}
    dim = lambda g: (g.dim, dims_b.get(g.id, g.dim))  # noqa: E731
    solved = opts.selected(unit.outer)  # else its blocks are kept in order
    out_res, res = S.nested_tree(
        [got.get(m.id) for m in members], [orthogonal_part(m.kind) for m in members],
        [m.pairs for m in members], [index[m.outer[-1]] if m.outer[-1] != root else -1 for m in members],
        [dim(m) for m in members], dim(unit.outer), inner=opts.inner,
        outer="identity" if not solved else "hungarian" if opts.solver not in ("ot", "sinkhorn") else "ot",
        masses=masses(unit.outer) if solved else None, scores=[scores.get(m.id) for m in members])
    if out_res is None:
        return []
    out = [(unit.outer, element_from(out_res), out_res)] if solved else []
    groups = {m.id: m for m in members} | {root: unit.outer}
    for m, r in zip(members, res):
        if r is None:
            continue
        sizes = [dims_b.get(o, groups[o].dim) for o in m.outer]  # B's blocks, outer to inner
        r.element = r.element.reshape(*sizes, *r.element.shape[-2:])
        out.append((m, element_from(r), r))
    return out


def element_from(result):
    """The one place where a solver's output becomes an element: a transport plan (sums to 1)
    becomes a :class:`Map` (rows averaged into A's units, columns summed: a function-preserving
    widening is undone exactly), except that an exact plan between equal widths is a
    permutation divided by n and is returned as that permutation. A soft (Sinkhorn) map is not
    a symmetry: B's function is only approximately kept."""
    el = result.element
    plan = result.extra.get("plan") or result.status == "soft" or el.shape[-1] != el.shape[-2]
    if not plan:
        return el
    if result.status != "soft" and el.shape[-1] == el.shape[-2]:
        P = (el * el.shape[-1]).round()
        if torch.allclose(el * el.shape[-1], P, atol=1e-9) and is_perm(P):
            return P
    return Map.from_plan(el)


def solve_single(g, s, opts, masses):
    """``(result, element)`` of one unfibred class ``g`` from its similarity ``s``, by its kind's
    solver (``opts``: the alignment options; ``masses(g)``: unit masses between widths, or None)."""
    kind = orthogonal_part(g.kind)
    nA, nB = s.shape[-2:]
    if s.dim() == 3:  # fibred over a fixed class, solved per fibre entry
        res_list = [S.solve(kind, s[h], pairs=g.pairs, solver=None if nA == nB else "ot")
                    for h in range(s.shape[0])]
        el = torch.stack([r.element for r in res_list])
        res = S.SolveResult(el, sum(r.objective for r in res_list), seconds=sum(r.seconds for r in res_list),
                            extra={"plan": any(r.extra.get("plan") for r in res_list)})
        return res, element_from(res)
    use = opts.solver if (opts.solver in ("ot", "sinkhorn") and kind in ("perm", "signed_perm")) else None
    ms = masses(g) if (use or nA != nB) else None
    res = S.solve(kind, s, pairs=g.pairs, solver=use, rescale=opts.rescale, reg=opts.reg,
                  dense=False, masses=ms)
    return res, element_from(res)
