"""Queries on a finished analysis, in union-find terms (roots): the matrix of a group element
along an axis, and the coordinate tables that index an axis by its leaf classes.

Only :mod:`symgraph.report` calls these; everything else asks the report, which speaks in
group ids. Elements are ``{root: element}`` here.

The matrix of an axis is built from its structure: a sum is block-diagonal; a product applies
each factor's element along its factor axis, innermost first (fibred elements are indexed by
their outer factor's *source* index), which is ``perm(heads) ≀ G(head_dim)``.
"""
from __future__ import annotations

import string

import numpy as np
import torch

from ..core.elements import Map, Perm, inv_t
from . import sites

__all__ = ["axis_matrix", "coord_table", "leaf_views", "other_leaf_elements", "observation_points",
           "leaves_with_parity", "stored_slots", "axis_tree", "resized_shapes",
           "leaf_element", "flat_factors", "gather_fibres", "application_order"]


def axis_matrix(an, axis: int, elements: dict, parity: int = 0):
    """Full ``n_A×n_B`` matrix acting on ``axis`` (float64), or None when it is the identity.

    For an unstructured axis whose element is a :class:`Perm`, the 1-D index vector instead
    (``P^{-T} = P``, so parity does not matter); :func:`apply_along` takes either."""
    r, _ = an.uf.find(axis)
    if r not in an.uf.struct and isinstance(elements.get(r), Perm):
        return elements[r].index
    E, fib = _node(an, axis, parity, elements)
    if fib:
        raise AssertionError("parameter axis with an unresolved fibre")  # analysis guarantees
    return E


def leaf_element(an, r, p, elements):
    """The element of leaf class ``r`` on an axis of parity ``p`` (its inverse transpose, or a
    map's contra side, when ``p``), shaped ``[*fibres, a, b]``, with its fibres; ``(None, ())``
    when the class has none."""
    E = elements.get(r)
    if E is None:
        return None, ()
    if isinstance(E, Perm):
        E = E.dense()
    elif isinstance(E, Map):
        E = E.contra if p else E.co
    elif p:
        E = inv_t(E)
    fib = an.fibre.get(r, ())
    return E.reshape(*(an.uf.size[f] for f in fib), *E.shape[-2:]), fib  # fibres may come flat


def flat_factors(an, axis, par):
    """Flatten nested products: list of (axis, parity) factors."""
    out, todo = [], [(axis, par)]
    while todo:
        a, pa = todo.pop()
        r, p = an.uf.find(a)
        s = an.uf.struct.get(r)
        if s is not None and s[0] == "prod":
            todo.extend((b, pb ^ p ^ pa) for b, pb in reversed(s[1]))
        else:
            out.append((a, pa))
    return out


def _node(an, axis, par, elements):
    """``(E, fibres)``: the matrix of ``axis`` (parity ``par``), fibred over the classes
    ``fibres``; ``(None, ())`` when it is the identity. Sums are walked, not recursed into
    (:meth:`~.unionfind.AxisUnionFind.fold`); a product (at most log2 of its size deep, its
    factors of size one dropped) builds its own."""
    def leaf(r, p):
        return leaf_element(an, r, p, elements) if r not in an.uf.struct else _product_node(an, r, p, elements)

    def combine(r, p, kind, values):
        return _sum_node(an, r, values)

    return an.uf.fold(axis, leaf, combine, par, expand=lambda kind: kind == "sum")


def _sum_node(an, r, values):
    """The matrix of the direct sum ``r``: its parts' matrices ``values`` (the identity for a
    part without one) on the diagonal, each broadcast over the fibres of all of them."""
    uf = an.uf
    subs = list(zip(values, uf.part_sizes(r)))
    if all(E is None for (E, _), _ in subs):
        return None, ()
    fibres = []
    for (E, f), _ in subs:
        fibres += [x for x in f if x not in fibres]
    blocks = []
    dev = next(E.device for (E, _), _ in subs if E is not None)  # the elements' device
    for (E, f), m in subs:
        E = torch.eye(m, dtype=torch.float64, device=dev) if E is None else E
        blocks.append(_broadcast_fibres(E, f, fibres, uf))
    na, nb = sum(b.shape[-2] for b in blocks), sum(b.shape[-1] for b in blocks)
    out = torch.zeros(*[uf.size[x] for x in fibres], na, nb, dtype=torch.float64, device=dev)
    oa = ob = 0
    for b in blocks:
        out[..., oa:oa + b.shape[-2], ob:ob + b.shape[-1]] = b
        oa, ob = oa + b.shape[-2], ob + b.shape[-1]
    return out, tuple(fibres)


def _product_node(an, axis, par, elements):
    """A product's matrix: each factor's element applied along its factor axis of the
    identity, in :func:`application_order`, fibred over the classes outside the product."""
    uf = an.uf
    n = uf.size[uf.find(axis)[0]]
    factors = flat_factors(an, axis, par)
    fclasses = [uf.find(a)[0] for a, _ in factors]
    fsizes = [uf.size[c] for c in fclasses]
    subs = []
    for a, pa in factors:
        ra, pra = uf.find(a)
        if ra in uf.struct:  # a sum inside a product
            subs.append(_node(an, a, pa, elements))
        else:
            subs.append(leaf_element(an, ra, pra ^ pa, elements))
    if all(E is None for E, _ in subs):
        return None, ()
    subs = [(E, f) if E is None else gather_fibres(an, E, f, k, factors, fclasses) for k, (E, f) in enumerate(subs)]
    outer = []
    for _, f in subs:
        outer += [x for x in f if x not in fclasses and x not in outer]
    letters = iter(string.ascii_letters)
    o_l = [next(letters) for _ in outer]
    f_l = [next(letters) for _ in factors]
    col = next(letters)
    osz = [uf.size[x] for x in outer]
    dev = next(E.device for E, _ in subs if E is not None)  # the elements' device
    X = torch.eye(n, dtype=torch.float64, device=dev).reshape(*fsizes, n)
    X = X.expand(*osz, *fsizes, n).clone() if osz else X
    for k in application_order(subs, fclasses):
        E, f = subs[k]
        if E is None:
            continue
        sub_l = [f_l[fclasses.index(x)] if x in fclasses else o_l[outer.index(x)] for x in f]
        new = next(letters)
        x_sub = o_l + f_l + [col]
        out_sub = o_l + [new if i == k else c for i, c in enumerate(f_l)] + [col]
        X = torch.einsum(f"{''.join(sub_l)}{new}{f_l[k]},{''.join(x_sub)}->{''.join(out_sub)}",
                         E, X)
    return X.reshape(*osz, -1, n), tuple(outer)


def gather_fibres(an, E, fib, k, factors, fclasses):
    """Factor ``k``'s element fibred over a leaf that lies inside another factor (a
    concatenation of copies of it: a head axis cut in halves, the halves one class) read per
    coordinate of that factor: ``E``'s fibre dim indexed by the leaf's coordinate there (every
    coordinate has one, else it stays unresolved), renamed to that factor."""
    fib = list(fib)
    for i, x in enumerate(fib):
        if x in fclasses:
            continue
        for j, ((a, _), c) in enumerate(zip(factors, fclasses)):
            idx = coord_table(an, a)[1].get(x) if j != k and c in an.uf.struct else None
            if idx is not None and (idx >= 0).all():
                E = E.index_select(i, torch.as_tensor(idx, device=E.device))
                fib[i] = c
                break
    return E, tuple(fib)


def application_order(subs, fclasses):
    """Innermost factor first, but a factor fibred over another factor of the same product
    always acts before it: fibred elements are indexed by the *source* index of their outer
    factor, whichever order the factors have in this flatten (``(H, d)`` or ``(d, H)``)."""
    needs = [{fclasses.index(x) for x in f if x in fclasses} for _, f in subs]
    left, order = list(range(len(subs))), []
    while left:
        ready = [k for k in left if not any(k in needs[m] for m in left if m != k)]
        k = max(ready) if ready else max(left)
        order.append(k)
        left.remove(k)
    return order


def _broadcast_fibres(E, have, want, uf):
    """Expand ``E [*have, a, b]`` to ``[*want, a, b]`` (``have`` ⊆ ``want``)."""
    if list(have) == list(want):
        return E
    perm = [list(have).index(x) for x in want if x in have]
    if have:
        E = E.permute(*perm, len(have), len(have) + 1)
    shape = [uf.size[x] if x in have else 1 for x in want]
    E = E.reshape(*shape, *E.shape[-2:])
    return E.expand(*[uf.size[x] for x in want], *E.shape[-2:])


def coord_table(an, axis):
    """Per coordinate of ``axis``: the index into each leaf class, and a path id that tells
    apart the segments of direct sums. Returns ``(paths [n], {leaf_root: idx [n] or -1})``.
    Memoised in ``an`` for each class on the way (an analysis' structures are final once it
    is built); a walk, not a recursion."""
    memo = an.__dict__.setdefault("_coord_tables", {})
    return an.uf.fold(axis, lambda r, p: _coord_leaf(an.uf.size[r], r),
                      lambda r, p, kind, subs: _coord_parts(an.uf.size[r], kind, subs), memo=memo)


def _coord_leaf(n, r):
    return np.zeros(n, np.int64), {r: np.arange(n)}


def _coord_parts(n, kind, subs):
    """:func:`coord_table` of a class of size ``n`` structured as ``kind`` over parts whose
    tables are ``subs``."""
    if kind == "sum":
        paths, leaves, off = [], {}, 0
        for k, (p, t) in enumerate(subs):
            m = len(p)
            paths.append(p * 64 + k + 1)
            for leaf, idx in t.items():
                arr = leaves.setdefault(leaf, np.full(n, -1, np.int64))
                arr[off:off + m] = idx
            off += m
        return np.concatenate(paths), leaves
    sizes = [len(p) for p, _ in subs]
    grids = np.meshgrid(*[np.arange(s_) for s_ in sizes], indexing="ij")
    grids = [g.reshape(-1) for g in grids]
    paths = np.zeros(n, np.int64)
    leaves = {}
    for k, ((p, t), g) in enumerate(zip(subs, grids)):
        paths = paths * 4096 + p[g]
        for leaf, idx in t.items():
            leaves[leaf] = idx[g]
    return paths, leaves


def _coord_parity(an, axis, par=0) -> dict:
    """Per coordinate of ``axis``: ``{leaf root: parity [n]}`` (1: the leaf acts there by its
    element's inverse transpose), along :func:`coord_table`'s layout."""
    uf = an.uf
    return uf.fold(axis, lambda r, p: {r: np.full(uf.size[r], p, np.int8)},
                   lambda r, p, kind, ts: _parity_parts(uf.size[r], kind, list(zip(ts, uf.part_sizes(r)))), par)


def _parity_parts(n, kind, subs) -> dict:
    """:func:`_coord_parity` of a class of size ``n`` structured as ``kind`` over parts
    ``subs`` (``(table, size)``)."""
    out: dict = {}
    if kind == "sum":
        off = 0
        for t, m in subs:
            for leaf, arr in t.items():
                out.setdefault(leaf, np.zeros(n, np.int8))[off:off + m] = arr
            off += m
        return out
    grids = np.meshgrid(*[np.arange(m) for _, m in subs], indexing="ij")
    for (t, _), g in zip(subs, grids):
        for leaf, arr in t.items():
            out[leaf] = arr[g.reshape(-1)]
    return out


def _views(an, axis, target):
    """Per occurrence of ``target`` on ``axis`` (sorted by path, so that two models agree):
    ``(coordinates, index array [*fibres, n_target, *others], fibres, others)``."""
    paths, leaves = coord_table(an, axis)
    if target not in leaves:
        return []
    fib = [f for f in an.fibre.get(target, ()) if f in leaves]
    out = []
    present = leaves[target] >= 0
    for path in sorted(set(paths[present].tolist())):
        cs = np.nonzero(present & (paths == path))[0]
        others = [leaf for leaf, idx in leaves.items()
                  if leaf != target and leaf not in fib and (idx[cs] >= 0).all()]
        dims = fib + [target] + others
        idx = np.full([an.uf.size[d] for d in dims], -1, np.int64)
        idx[tuple(leaves[d][cs] for d in dims)] = cs
        if not (idx < 0).any():
            out.append((cs, idx, fib, others))
    return out


def leaf_views(an, axis, target, with_parity: bool = False):
    """Index arrays ``[*fibre_sizes, n_target, *other_leaf_sizes]`` into ``axis``'s coordinates,
    one per occurrence of ``target`` (sorted by path so that two models agree); with
    ``with_parity``, each with its parity (1: ``target`` acts there by ``E⁻ᵀ``, "contra")."""
    parity = _coord_parity(an, axis)[target] if with_parity else None
    out = []
    for cs, idx, fib, _ in _views(an, axis, target):
        view: tuple = (torch.as_tensor(idx, device="cpu"), len(fib))  # structure: on the CPU
        out.append(view + (int(parity[cs[0]]),) if parity is not None else view)
    return out


def other_leaves(an, axis, target) -> list:
    """Per view of :func:`leaf_views` (same order), the roots of its other leaves."""
    return [list(others) for *_, others in _views(an, axis, target)]


def other_leaf_elements(an, axis, target, elements):
    """Per view of :func:`leaf_views` (same order), ``[(position among its O, element, fibre
    positions)]`` for its other leaves that have elements, or None for a view where one of them
    is a class without an element yet. Each occurrence has its own other leaves (a packed
    projection's query part has the query heads beside the head dimensions, its key part not)."""
    out = []
    for _, _, fib, others in _views(an, axis, target):
        dims = fib + [target] + others
        mine = []
        for j, leaf in enumerate(others):
            E = elements.get(leaf)
            if E is None:
                if an.kind(leaf) != "identity" and an.uf.size[leaf] > 1:
                    mine = None
                    break
                continue
            E = E.co if isinstance(E, Map) else E.dense() if isinstance(E, Perm) else E
            lf = an.fibre.get(leaf, ())
            if any(f not in dims for f in lf):
                continue
            E = E.reshape(*(an.uf.size[f] for f in lf), *E.shape[-2:])  # fibres may come flat
            mine.append((j, E, [dims.index(f) for f in lf]))
        out.append(mine)
    return out


def observation_points(an, root, limit=24):
    """``(node, dim)`` where ``root``'s coordinates can be read from an activation: the
    output of an op whose rule is marked ``observe`` (see :func:`registry.register`), with
    ``root`` on that dim and only fixed classes (batch, sequence) on the others, which become
    samples. At most ``limit``, evenly spread through the graph. Not where a mask's fill
    value may be (:func:`~.masks.filled_nodes`: eager attention's masked scores)."""
    from .registry import observed
    from .masks import filled_nodes
    pts, filled = [], filled_nodes(an.graph)
    for node, ax in an.node_axes.items():
        if node.op != "call_function" or an.origin.get(node) != "act" or not ax or isinstance(ax[0], list):
            continue
        if not observed(node.target) or node in an.unobservable or node in filled:
            continue
        for k, a in enumerate(ax):
            if root in set(an.leaves(a)):
                if all(an.kind(leaf) == "identity" for j, b in enumerate(ax) if j != k
                       for leaf in an.leaves(b)):
                    pts.append((node, k))
                break
    if len(pts) > limit:
        sel = np.linspace(0, len(pts) - 1, limit).round().astype(int)
        pts = [pts[i] for i in sorted(set(sel.tolist()))]
    return pts


def stored_slots(an, nodes) -> dict:
    """``{leaf root: [(name, dim, "co" | "contra")]}`` of the placeholders ``nodes``."""
    out: dict[int, list] = {}
    for name, node in nodes.items():
        for d, a in enumerate(an.node_axes[node]):
            for leaf, par in leaves_with_parity(an, a, 0):
                out.setdefault(leaf, []).append((name, d, "contra" if par else "co"))
    return out


def leaves_with_parity(an, axis, par=0):
    """``[(leaf root, parity)]`` of ``axis``: itself, or its structure's parts' leaves, in
    order (:meth:`~.unionfind.AxisUnionFind.leaves`)."""
    return an.uf.leaves(axis, par)


def linear_layers(an) -> list:
    """Linear maps on a parameter: ``[(weight name, input node name, input feature axis,
    layout)]`` with layout ``"out_in"`` (``linear``, or ``x @ W.T``: a matmul by a transposed
    2-d parameter) or ``"in_out"`` (``addmm``, or ``x @ W``)."""
    aten = torch.ops.aten
    rev = {n: k for k, n in an.param_nodes.items()}
    out = []
    for node in an.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target == aten.linear.default and node.args[1] in rev:
            w, x, layout = rev[node.args[1]], node.args[0], "out_in"
        elif node.target == aten.addmm.default and node.args[2] in rev:
            w, x, layout = rev[node.args[2]], node.args[1], "in_out"
        elif (found := matmul_weight(node, lambda n: n in rev)) is not None:
            w, x, layout = rev[found[0]], node.args[0], found[1]
        else:
            continue
        out.append((w, x.name, an.node_axes[x][-1], layout))
    return out


def matmul_weight(node, is_param) -> tuple | None:
    """``(weight node, layout)`` when ``node`` multiplies a value by a 2-d parameter on the right
    (``matmul`` or ``mm``): ``x @ W`` is ``"in_out"``, ``x @ W.T`` (``W`` through ``t``, a
    ``permute`` or ``transpose`` of its two dims, used there only) ``"out_in"``; else None."""
    aten = torch.ops.aten
    if node.op != "call_function" or node.target not in (aten.matmul.default, aten.mm.default) \
            or len(node.args) < 2 or not isinstance(node.args[0], torch.fx.Node) or is_param(node.args[0]):
        return None
    w, layout = node.args[1], "in_out"
    if isinstance(w, torch.fx.Node) and w.op == "call_function" and len(w.users) == 1 and w.args \
            and isinstance(w.args[0], torch.fx.Node) and is_param(w.args[0]) and _swaps_2d(w):
        w, layout = w.args[0], "out_in"
    val = w.meta.get("val") if isinstance(w, torch.fx.Node) else None
    if not (isinstance(w, torch.fx.Node) and is_param(w) and val is not None and val.dim() == 2):
        return None
    return w, layout


def _swaps_2d(node) -> bool:
    """Whether ``node`` transposes a 2-d tensor (``t``, ``permute(1, 0)``, ``transpose(0, 1)``)."""
    aten = torch.ops.aten
    if node.target == aten.t.default:
        return True
    if node.target == aten.permute.default:
        return list(node.args[1]) == [1, 0]
    if node.target == aten.transpose.int:
        return {d % 2 for d in node.args[1:3]} == {0, 1}
    return False


def attention_sites(an) -> list:
    """``[(node name, query head-size axis, value head-size axis)]`` per attention op,
    ``scaled_dot_product_attention`` or written out (:func:`.sites.attention_sites`)."""
    return sites.attention_sites(an)


def axis_tree(an, axis, name=lambda r: r):
    """``axis`` down to its leaf classes: ``("leaf", size, name(root))`` or ``(kind,
    [subtrees])`` with kind ``"prod"`` (row-major flatten) or ``"sum"`` (concatenation)."""
    return an.uf.fold(axis, lambda r, p: ("leaf", an.uf.size[r], name(r)), lambda r, p, kind, subs: (kind, subs))


def resized_shapes(an, sizes: dict) -> dict:
    """Every node's output shape (a list of shapes for a list output) when the leaf classes
    ``sizes`` (``{root: new size}``) change size and every other class keeps its own."""
    memo: dict = {r: int(n) for r, n in sizes.items()}

    def size(a):
        return an.uf.fold(a, lambda r, p: an.uf.size[r],
                          lambda r, p, kind, parts: int(np.prod(parts)) if kind == "prod" else sum(parts), memo=memo)

    def walk(x):
        if isinstance(x, (list, tuple)) and all(isinstance(v, int) for v in x):
            return tuple(size(a) for a in x)
        return [None if v is None else walk(v) for v in x] if isinstance(x, (list, tuple)) else None

    return {node.name: walk(axes) for node, axes in an.node_axes.items() if axes is not None}
