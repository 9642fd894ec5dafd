"""Nested matching of any depth: an outer class, classes fibred over it, classes fibred over
those, ... (expert groups, the experts within a group, each expert's hidden units).

:func:`~._solvers.nested_heads` matches one level (heads, then each head pair's inner class).
Here a class ``c`` whose blocks are indexed by its outer classes scores each pair of blocks
``(f_A, f_B)`` and of its units ``(i, j)`` by its own similarity plus, for each class fibred
directly over it, that class's best match between the blocks ``(f_A, i)`` and ``(f_B, j)``;
its best match per block pair is then what its own outer class reads, up to the outer class,
which is matched once. The elements are read back from the outer match down: a class's blocks
pair as its outer class's blocks and units were matched."""
from __future__ import annotations

from typing import Any

import torch

from ..core.groups import GroupKind
from ._solvers import SolveResult, hungarian, optimal_transport, pair_objectives, procrustes

__all__ = ["nested_tree"]


def nested_tree(S: list, kinds: list[GroupKind], pairs: list, parent: list, dims: list, outer_dims: tuple,
                inner: str = "procrustes", outer: str = "hungarian", masses=None, scores=None) -> tuple:
    """Match an outer class and the classes nested under it.

    ``S[c]``: ``[F_A, F_B, n_A, n_B]`` (the blocks of class ``c``, its outer classes' indices
    flattened outer to inner, against each other) or None (no similarity of its own);
    ``parent[c]``: the index of the class ``c`` is directly fibred over, -1 for the outer
    class; ``dims[c]`` / ``outer_dims``: ``(n_A, n_B)`` of class ``c`` / the outer class.
    ``scores[c]``: ``[F_A, F_B]`` (or None) in place of a rotation class's inner optimum.
    ``outer``: "hungarian" (an assignment; a transport between different sizes), "ot" (a
    transport, ``masses`` its marginals), or "identity" (the outer class not solved: block
    ``b`` of B with block ``b`` of A).
    Returns ``(outer_result, [SolveResult with element [F_B, n_A, n_B], or None, per class])``:
    block ``f`` of B's class holds the map of B's block ``f`` into the A block it is matched to.
    """
    n = len(S)
    kids = [[d for d in range(n) if parent[d] == c] for c in range(n)]
    F: list[Any] = [None] * n  # (F_A, F_B) per class
    for c in _top_down(parent):
        F[c] = outer_dims if parent[c] < 0 else (F[parent[c]][0] * dims[parent[c]][0],
                                                 F[parent[c]][1] * dims[parent[c]][1])
    scores = list(scores or [None] * n)
    V, obj, sol, secs = _bottom_up(S, kinds, pairs, parent, kids, F, dims, inner, scores)
    tops = [c for c in range(n) if parent[c] < 0 and obj[c] is not None]
    if not tops:
        return None, [None] * n
    score: torch.Tensor = obj[tops[0]]
    for c in tops[1:]:
        score = score + obj[c]
    HA, HB = outer_dims
    if outer == "identity" and HA == HB:  # the outer class is not solved: block b with block b
        eye = torch.eye(HA, dtype=torch.float64, device=score.device)
        out = SolveResult(eye, float(score.diagonal().sum()))
    else:
        out = (hungarian(score) if (outer == "hungarian" and HA == HB)
               else optimal_transport(score, a=(masses or (None, None))[0], b=(masses or (None, None))[1]))
    assert isinstance(out.element, torch.Tensor)  # a dense assignment or plan
    results, more = _read_back(out.element, S, parent, F, dims, V, sol, score.device)
    out.seconds += secs + more
    return out, results


def _bottom_up(S, kinds, pairs, parent, kids, F, dims, inner, scores):
    """Every class after the classes fibred over it: its block pairs' similarity ``V[c]`` (its
    own plus each inner class's best match of ``(f_A, i)`` with ``(f_B, j)``), their best
    objectives and, for a class solved per pair, the elements. Returns ``(V, obj, sol,
    seconds)``."""
    n = len(S)
    V: list[Any] = [None] * n
    obj: list[Any] = [None] * n
    sol: list[Any] = [None] * n
    secs = 0.0
    for c in reversed(_top_down(parent)):
        v = None if S[c] is None else torch.as_tensor(S[c], dtype=torch.float64)
        (fa, fb), (na, nb) = F[c], dims[c]
        for d in kids[c]:
            if obj[d] is not None:  # d's best match of (f_A, i) with (f_B, j), as [F_A, F_B, n_A, n_B]
                add = obj[d].reshape(fa, na, fb, nb).permute(0, 2, 1, 3)
                v = add if v is None else v + add.to(v.device)
        if v is None:
            continue
        V[c] = v
        obj[c], sol[c], t = pair_objectives(v, kinds[c], pairs[c], inner, scores[c] if not kids[c] else None)
        secs += t
    return V, obj, sol, secs


def _read_back(outer_element, S, parent, F, dims, V, sol, dev):
    """The elements from the outer match down: a class's blocks pair as its outer class's
    blocks and units were matched. Returns ``([SolveResult or None per class], seconds)``."""
    n = len(S)
    secs = 0.0
    match: list[Any] = [None] * n  # per class: B's block f -> the A block it is matched to
    results: list[Any] = [None] * n
    for c in _top_down(parent):
        p = parent[c]
        if p < 0:
            match[c] = outer_element.argmax(0).to(dev)
        elif results[p] is not None:  # (f_B, j) -> (match of f_B, the A unit j went to)
            units = results[p].element.argmax(-2).to(dev)  # [F_B(p), n_B(p)]
            match[c] = (match[p][:, None] * dims[p][0] + units).reshape(-1)
        if V[c] is None or match[c] is None:
            continue
        blocks = torch.arange(F[c][1], device=dev)
        if sol[c] is None:  # rotations of the matched pairs only
            res = procrustes(V[c][match[c], blocks])
            secs += res.seconds
            assert isinstance(res.element, torch.Tensor)
            el = res.element
        else:
            el = sol[c][match[c], blocks]
        nA, nB = dims[c]
        own = 0.0 if S[c] is None else float((el * torch.as_tensor(S[c], dtype=torch.float64)[match[c], blocks]).sum())
        results[c] = SolveResult(el, own, extra={"plan": nA != nB})
    return results, secs

def _top_down(parent) -> list:
    """The classes' indices, each after the class it is fibred over."""
    order: list[int] = []
    seen: set[int] = set()
    while len(order) < len(parent):
        if not any(c not in seen and (p < 0 or p in seen) for c, p in enumerate(parent)):
            raise ValueError(f"classes fibred in a cycle or over a class not given: {parent}")
        for c, p in enumerate(parent):
            if c not in seen and (p < 0 or p in seen):
                order.append(c)
                seen.add(c)
    return order
