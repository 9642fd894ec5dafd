"""Fibres: the classes whose elements may differ per coordinate of another class (a head's
dimensions per head, an expert's hidden units per expert).

A leaf class ``L`` is a candidate to be fibred over a permutation (or fixed) class ``X`` that
precedes it in a product structure (``heads × head_dim``), or over the label class on another
axis of a stored tensor (experts, :mod:`.patterns.stacked`). It keeps ``X`` only where every
tensor it appears in tells, at each of its coordinates, which coordinate of ``X`` it belongs
to: ``X`` on another axis of an activation, a label class the activation carries, or ``X``
on the same axis at *every* coordinate where ``L`` is (a product of the two, or of ``L`` and
a concatenation of copies of ``X``, as a head axis cut in halves and the halves unified);
stored tensors only on the same axis (or, on another one, a label class or a class a product
puts before ``L``, as XLNet's ``q [d_model, heads, head_dim]`` read as ``d_model × (heads ·
head_dim)``: :func:`.patterns.stacked.stack` then views the tensor as a product). A class of
one coordinate neither has nor is a fibre (one block is no fibre). Dropping a candidate is
always sound: one element for every coordinate of ``X`` is a subgroup of one per coordinate.
"""
from __future__ import annotations

from .axes import coord_table
from .nodes import tensor_axes
from .patterns import stacked

__all__ = ["compute_fibres"]


def compute_fibres(an) -> None:
    """Set ``an.fibre`` (``{leaf root: (fibre roots, outer to inner)}``) and ``an.stacked``."""
    cand = _prod_candidates(an)
    classes = stacked.label_classes(an)  # experts: fibres across a parameter's axes
    carry = stacked.carried(an, classes) if classes else {}
    for node in an.param_nodes.values() if classes else ():
        for a, other in zip(an.node_axes[node], _labelled(an, node, classes)):
            for leaf in an.leaves(a):
                cand.setdefault(leaf, set()).update(other - {leaf})
    beside = _beside(an, cand)  # heads stored on their own axis (XLNet's q [d, heads, head_dim])
    outer = classes | beside
    labelled = {node: _labelled(an, node, outer) for node in an.param_nodes.values()} \
        if outer else {}
    fib = {leaf: {x for x in c if an.uf.size[x] > 1} for leaf, c in cand.items()
           if an.uf.size[leaf] > 1}
    fib = {leaf: c for leaf, c in fib.items() if c}
    buffers = set(an.buffer_nodes.values())
    if fib:
        for node, ax in an.node_axes.items():
            if ax is None:
                continue
            stored = an.origin.get(node) == "param" or node in buffers
            for t in tensor_axes(ax):
                leaves = [an.leaves(a) for a in t]
                for j, a in enumerate(t):
                    if stored:  # the same axis, or a label class on another axis
                        around = set(labelled[node][j]) if node in labelled else set()
                    else:  # any other axis, or a label class the rows carry
                        around = {f for r in carry.get(node, ()) for f in stacked.members(an, r)}
                        around.update(x for k, ls in enumerate(leaves) if k != j for x in ls)
                    for leaf in set(leaves[j]) & fib.keys():
                        fib[leaf] &= around | _resolved(an, a, leaf)
        for a, over in an.nofiber:
            for leaf in an.leaves(a):
                if leaf in fib:
                    fib[leaf] -= set(an.leaves(over))
    an.fibre = {leaf: tuple(sorted(f)) for leaf, f in fib.items() if f and an.kind(leaf) != "identity"}
    an.stacked = stacked.stack(an, classes, beside) if outer else {}
    _order_fibres(an)
    _chains(an)


def _resolved(an, axis, leaf) -> set:
    """The other leaf classes of ``axis`` that have a coordinate at every coordinate of
    ``axis`` where ``leaf`` has one."""
    r = an.uf.find(axis)[0]
    if r not in an.uf.struct:
        return set()
    memo = an.__dict__.setdefault("_resolved", {})
    if (r, leaf) not in memo:
        _, idx = coord_table(an, axis)
        at = idx[leaf] >= 0
        memo[r, leaf] = {x for x, ix in idx.items() if x != leaf and bool((ix[at] >= 0).all())}
    return memo[r, leaf]


def _prod_candidates(an) -> dict:
    """For each leaf class, the permutation or fixed leaves that precede it in some product."""
    cand: dict[int, set] = {}
    for r in list(an.roots):
        form, parts = an.uf.struct.get(r, (None, ()))  # a product, a sum or none
        if form != "prod":
            continue
        seen: list = []
        for p, _ in parts:
            pl = an.leaves(p)
            for leaf in pl:
                cand.setdefault(leaf, set()).update(x for x in seen if an.kind(x) in ("perm", "identity"))
            seen += pl
    return cand


def _beside(an, cand) -> set:
    """Roots of the leaf classes that a product made a candidate base of another leaf (heads
    before head dims) and that a stored tensor holds on another axis than that leaf, unsplit
    (XLNet's ``q [d_model, heads, head_dim]``, read through a view as ``d_model × (heads ·
    head_dim)``). Such a tensor says per coordinate which head it belongs to, as a label class
    on another axis says which expert: :func:`.patterns.stacked.stack` views it as a product."""
    out: set = set()
    for node in an.param_nodes.values():
        roots = [an.uf.find(a)[0] for a in an.node_axes[node]]
        for j, a in enumerate(an.node_axes[node]):
            for leaf in stacked.alone(an, a):
                out.update(r for o, r in enumerate(roots)
                           if o != j and r not in an.uf.struct and r in cand.get(leaf, ()))
    return out


def _labelled(an, node, classes) -> list:
    """Per axis of parameter ``node``: the label classes on its other axes."""
    roots = [an.uf.find(a)[0] for a in an.node_axes[node]]
    here = [set(stacked.members(an, r)) if r in classes else set() for r in roots]
    return [set().union(*(h for o, h in enumerate(here) if o != j)) for j in range(len(here))]


def _order_fibres(an) -> None:
    """Order each fibre outer to inner as its classes appear in a product structure."""
    order: dict = {}
    for r in an.roots:
        if r in an.uf.struct and an.uf.struct[r][0] == "prod":
            for i, leaf in enumerate(an.leaves(r)):
                order.setdefault(leaf, i)
    an.fibre = {k: tuple(sorted(v, key=lambda x: order.get(x, 0))) for k, v in an.fibre.items()}


def _chains(an) -> None:
    """Keep of each fibre its longest inner part that is a chain: every class of it fibred over
    exactly the ones before it (an expert group, its experts, each expert's hidden units). A
    class fibred over classes that are not (a head dim over a grouped convolution's groups and
    the heads inside a group, when those heads are one permutation for every group) loses the
    outer ones: elements are solved nested along a chain only, and dropping is sound."""
    done: dict = {}

    def chain(leaf) -> tuple:
        if leaf not in done:
            done[leaf] = ()  # a cycle (never expected) keeps nothing
            fib = an.fibre.get(leaf, ())
            keep = next((fib[j:] for j in range(len(fib))
                         if len(fib) - j == 1 or chain(fib[-1]) == fib[j:-1]), ())
            done[leaf] = keep
        return done[leaf]

    for leaf in list(an.fibre):
        kept = chain(leaf)
        if kept:
            an.fibre[leaf] = kept
        else:
            del an.fibre[leaf]
