"""Stacked parameters: one tensor holding a weight per member of a label class.

A mixture-of-experts block stores its experts' weights stacked, ``gate_up_proj [E, 2I, d]``
and ``down_proj [E, d, I]``, and every token's rows are picked by the router's labels
(``gate_up_proj[expert_ids]``, :mod:`symgraph.passes.labels`). Each expert's hidden units may
be permuted on their own: ``W'[e] = P_e W[e]`` along the hidden axis of both weights is
invariant, because a token routed to expert ``e`` meets ``P_e`` on the way in and
``P_eᵀ`` on the way out. So the hidden class is *fibred* over the expert class, as a head's
dimensions are fibred over the heads, except that the experts sit on another axis of the
stored tensor instead of being an outer factor of the same one.

A class ``L`` is fibred over a label class ``E`` only where every tensor it appears in tells,
per coordinate, which member of ``E`` it belongs to:

- a stored tensor with ``E`` on another of its axes;
- an activation that *carries* ``E``: rows picked by ``E``'s labels (``w[labels]``), and what
  ops that keep those rows apart compute from them (elementwise ops, relayouts, splits,
  batched matmuls), as long as the labels' axes are still axes of the result (a sum over
  the token or slot axis mixes experts and ends the carry). Anything else ends it, so a
  tensor with ``L`` that does not carry ``E`` (a shared bias, a reduction) keeps one ``L``
  element for all experts (:func:`~symgraph.passes.fibres.compute_fibres`).

A parameter whose axis ``j`` holds such a class and axis ``o`` the label class is then
*viewed* with the two axes as one product axis ``(E, L)`` (``movedim`` + ``flatten``,
:func:`view_of`): every consumer of a report (apply, weight matching, masses) sees the fibre as
it sees ``heads × head_dim``, and :meth:`SymmetryReport.view <symgraph.SymmetryReport.view>`
/ ``unview`` move tensors between the stored and the viewed layouts.
"""
from __future__ import annotations

import math
import operator

import torch

from ..labels import RELAYOUT, label_index
from ..nodes import packet, tensor_axes

__all__ = ["carried", "label_classes", "alone", "members", "stack", "view_of", "unview_of"]

aten = torch.ops.aten

#: Largest ``(members × units)²`` of a per-member class (:func:`stack`).
MAX_STACKED = 4096 ** 2

_KEEP_ROWS = RELAYOUT | {aten.split, aten.split_with_sizes, aten.chunk, aten.bmm, aten.matmul,
                         aten.mm, aten.baddbmm, aten.addmm}


def label_classes(an) -> set:
    """Roots of the permutation classes some label tensor labels."""
    out = set()
    for axis, _size in an.labels.values():
        r = an.uf.find(axis)[0]
        if an.kind(r) == "perm":
            out.add(r)
    return out


def members(an, r) -> list:
    """The leaf classes whose coordinates name the members of label class ``r``: ``[r]``, or
    the factors of a product (DeepSeek's group-limited routing reads the experts as
    ``groups × experts per group``: a permutation of the groups and, per group, of its
    experts); none for a class cut into segments."""
    r = an.uf.find(r)[0]
    s = an.uf.struct.get(r)
    if s is None:
        return [r]
    if s[0] != "prod":
        return []
    out = []
    for p, _ in s[1]:
        sub = members(an, p)
        if not sub:
            return []
        out += sub
    return out


def _roots(an, axes) -> frozenset:
    return frozenset(an.uf.find(a)[0] for a in axes)


def carried(an, classes) -> dict:
    """``{node: {label root: roots of the labels' axes}}``: the activations whose rows belong,
    each, to the member of a label class that its labels name (see the module docstring)."""
    carry: dict = {}
    for node in an.graph.nodes:
        if node.op != "call_function" or an.origin.get(node) != "act":
            continue
        picked = label_index(node, an.labels)
        if picked is not None:
            k, idx = picked
            r = an.uf.find(an.labels[idx][0])[0]
            src = an.node_axes.get(node.args[0])
            if r in classes and src and an.uf.find(src[k])[0] == r:  # joined: w[labels]
                carry[node] = {r: _roots(an, an.node_axes[idx])}
                continue
        ins = [i for i in node.all_input_nodes if i in carry]
        if not ins or not _keeps_rows(node):
            continue
        merged: dict = {}
        for i in ins:
            for r, rows in carry[i].items():
                merged[r] = rows if merged.get(r, rows) == rows else None  # two label sets: none
        outs = [_roots(an, t) for t in tensor_axes(an.node_axes.get(node))]
        keep = {r: rows for r, rows in merged.items()
                if rows is not None and outs and all(rows <= o for o in outs)}
        if keep:
            carry[node] = keep
    return carry


def _keeps_rows(node) -> bool:
    t = node.target
    if t is operator.getitem:
        return True
    if isinstance(t, torch._ops.OpOverload) and torch.Tag.pointwise in t.tags:
        return True
    return packet(t) in _KEEP_ROWS


def stack(an, classes, beside=frozenset()) -> dict:
    """Parameters whose axis ``j`` holds a class fibred over the label class on axis ``o``, or
    over one of the classes ``beside`` (heads stored on their own axis, as XLNet's
    ``q [d_model, heads, head_dim]``): ``{name: (o, j)}``, with their node axes replaced by the
    viewed ones (a new product axis ``(E, L)`` at ``o``). A class fibred over ``E`` on two
    axes of one tensor cannot be viewed so: it loses that fibre (one element for every member:
    a subgroup, still sound). The stored axes of the viewed parameters are kept in
    ``an.raw_axes``.

    Per-member elements cost ``(E·L)²`` entries where they act (the viewed axis' matrix, the
    nested matching's similarity of every member pair): beyond :data:`MAX_STACKED` (as much
    as the head maps of a 4096-wide attention) the class keeps one element for all members,
    and ``an.shared[leaf]`` says why (not over ``beside``: per-head maps cost what they cost
    for heads reshaped from one axis)."""
    an.raw_axes, an.shared = {}, {}
    _share_large(an, classes)
    outer = set(classes) | set(beside)
    while True:
        plan, drop = {}, set()
        for name, node in an.param_nodes.items():
            ax = an.node_axes[node]
            for o, a in enumerate(ax):
                r = an.uf.find(a)[0]
                mset = set(members(an, r)) if r in outer else set()
                if not mset:
                    continue
                held = an.leaves if r in classes else lambda b: alone(an, b)  # heads: see alone
                dims = [j for j, b in enumerate(ax) if j != o
                        and any(mset & set(an.fibre.get(leaf, ())) for leaf in held(b))]
                if len(dims) == 1 and name not in plan:
                    plan[name] = (o, dims[0])
                elif dims:
                    drop |= {(leaf, m) for j in dims for leaf in an.leaves(ax[j]) for m in mset}
        if not drop:
            break
        for leaf, r in drop:
            if leaf in an.fibre:
                an.fibre[leaf] = tuple(f for f in an.fibre[leaf] if f != r)
                if not an.fibre[leaf]:
                    del an.fibre[leaf]
    for name, (o, j) in plan.items():
        _view_axes(an, name, o, j)
    return plan


def _share_large(an, classes):
    """One element for every member of a fibre whose per-member elements would exceed
    :data:`MAX_STACKED` entries (``an.shared[leaf]`` says why)."""
    of = {m: r for r in classes for m in members(an, r)}  # member leaf -> its label class
    for leaf, fib in list(an.fibre.items()):  # stored flat ([E·I, d]) or stacked alike
        for r in {of[f] for f in fib if f in of}:
            ms = [f for f in fib if of.get(f) == r]
            n = math.prod(an.uf.size[f] for f in ms)
            if (n * an.uf.size[leaf]) ** 2 > MAX_STACKED:
                an.shared[leaf] = (f"one order for all {n} members: per-member "
                                   f"elements would need more than {MAX_STACKED} entries "
                                   "(symgraph.passes.patterns.stacked.MAX_STACKED)")
                an.fibre[leaf] = tuple(f for f in an.fibre[leaf] if f not in ms)
        if not an.fibre[leaf]:
            del an.fibre[leaf]


def _view_axes(an, name, o, j):
    """``name``'s node axes with axis ``j`` folded into axis ``o`` (a new product axis); its
    stored axes kept in ``an.raw_axes``."""
    node = an.param_nodes[name]
    ax = list(an.node_axes[node])
    an.raw_axes[name] = list(ax)
    m = an.uf.new(an.uf.size[an.uf.find(ax[o])[0]] * an.uf.size[an.uf.find(ax[j])[0]])
    an.uf.add_structure(m, "prod", [ax[o], ax[j]])
    an.roots.add(an.uf.find(m)[0])
    ax[o] = m
    del ax[j]
    an.node_axes[node] = ax


def alone(an, axis) -> list:
    """``[leaf]`` where ``axis`` holds one leaf class alone, else ``[]``. Heads on their own axis
    are viewed with a head-dim axis only when that axis holds the head dims alone (XLNet's
    ``q [d_model, heads, head_dim]``): an axis holding a product (Doge's ``dt_proj.weight [heads,
    kv_heads · head_dim]``, each row reading every head's dims) already carries its blocks."""
    leaves = an.leaves(axis)
    return leaves if len(leaves) == 1 else []


def _pos(o, j):
    """Where the stacked axis lands in the viewed tensor."""
    return o if j > o else o - 1


def view_of(t, o, j):
    """``t`` with axis ``j`` moved right after axis ``o`` and the two flattened (``o`` outer)."""
    p = _pos(o, j)
    return t.movedim(j, p + 1).flatten(p, p + 1)


def unview_of(x, o, j, shape):
    """Inverse of :func:`view_of` for a stored tensor of ``shape`` (the outer size is read
    from ``x``: a resize may have changed the number of members)."""
    p = _pos(o, j)
    return x.unflatten(p, (-1, shape[j])).movedim(p + 1, j)
