"""Pattern pass: a packed projection unflattened and then taken apart entry by entry.

``nn.MultiheadAttention`` computes Q, K and V with one ``in_proj`` and separates them by
``unflatten(-1, (3, E))``, relayouts, then ``select(0, i)`` for i = 0, 1, 2. Read op by op, the
``3E`` axis is the product ``3 × E`` with *one* ``E`` class for Q, K and V: sound, but Q/K and
V/O can then only share one orthogonal map. When every use of the unflattened tensor ends, after
relayouts only (unsqueeze, transpose, permute, squeeze, contiguous, clone), in a constant
``select`` (or ``unbind``) along the new leading axis, it is a split: the packed axis is the
*sum* ``E ⊕ E ⊕ E`` of independent parts (as ``split`` gives), each entry's tensor carrying its
own part, and the usual attention rules then find QK and VO classes per head. The same holds
when the packed axis is unflattened (or viewed) into more factors, the count first:
ModernBERT's ``view(b, s, 3, H, d)`` then ``unbind(dim=-3)`` gives each entry an ``H × d``
part, a product of its own head and head-dimension axes.
"""
from __future__ import annotations

import operator

import torch

from ..nodes import packet
from ..registry import Structure, Unify

__all__ = ["find_packed"]

aten = torch.ops.aten

_RELAYOUT = {aten.unsqueeze, aten.transpose, aten.permute, aten.squeeze, aten.contiguous,
             aten.clone, aten.alias}


def _relayout(labels, node):
    """The axis labels of ``node``'s output from its input's, or None if not understood."""
    p, a = packet(node.target), node.args
    n = len(labels)
    if p in (aten.contiguous, aten.clone, aten.alias):
        return list(labels)
    if p is aten.unsqueeze:
        d = a[1] % (n + 1)
        return labels[:d] + [None] + labels[d:]
    if p is aten.transpose:
        i, j = a[1] % n, a[2] % n
        out = list(labels)
        out[i], out[j] = out[j], out[i]
        return out
    if p is aten.permute:
        return [labels[d % n] for d in a[1]]
    if p is aten.squeeze and len(a) > 1:
        dims = a[1] if isinstance(a[1], (list, tuple)) else [a[1]]
        dims = {d % n for d in dims}
        if any(labels[d] is not None for d in dims):  # only inserted unit axes go away
            return None
        return [x for k, x in enumerate(labels) if k not in dims]
    return None


def _ends(node, labels, out):
    """Collect ``(select node, entry, labels of its output)`` for every path from ``node``;
    False if a path does anything else."""
    for u in node.users:
        p = packet(u.target)
        if p is aten.select and u.args[0] is node and labels[u.args[1] % len(labels)] == "n":
            k = u.args[1] % len(labels)
            out.append((u, u.args[2], labels[:k] + labels[k + 1:]))
        elif (p is aten.unbind and u.args[0] is node
              and labels[(u.args[1] if len(u.args) > 1 else 0) % len(labels)] == "n"):
            k = (u.args[1] if len(u.args) > 1 else 0) % len(labels)
            for g in u.users:
                if g.target is not operator.getitem or not isinstance(g.args[1], int):
                    return False
                out.append((g, g.args[1], labels[:k] + labels[k + 1:]))
        elif p in _RELAYOUT and u.args[0] is node:
            lab = _relayout(labels, u)
            if lab is None or not _ends(u, lab, out):
                return False
        else:
            return False
    return True


def find_packed(an):
    """``(claimed nodes, constraints)`` for every packed projection taken apart by entry."""
    claimed, cons = set(), []
    for node in an.graph.nodes:
        if node.op != "call_function":
            continue
        split = _last_axis_split(an, node)
        if split is None:
            continue
        x, xa, n, ms = split
        labels = list(range(len(xa) - 1)) + ["n"] + [("m", j) for j in range(len(ms))]
        ends = []
        if not _ends(node, labels, ends) or sorted(e for _, e, _ in ends) != list(range(n)):
            continue
        parts = [an.uf.new(int(torch.tensor(ms).prod())) for _ in range(n)]
        cons.append(Structure(xa[-1], "sum", tuple(parts)))
        factors = [[p] if len(ms) == 1 else [an.uf.new(m) for m in ms] for p in parts]
        if len(ms) > 1:
            cons += [Structure(p, "prod", tuple(f)) for p, f in zip(parts, factors)]
        for sel, entry, lab in ends:
            for o, tag in zip(an.axes_of(sel), lab):
                if isinstance(tag, tuple):
                    cons.append(Unify(o, factors[entry][tag[1]]))
                elif tag is not None:
                    cons.append(Unify(o, xa[tag]))
            claimed.add(sel)
        claimed |= _chain(node, {s for s, _, _ in ends})
    return claimed, cons


def _last_axis_split(an, node):
    """``(input, its axes, n, [m, ...])`` when ``node`` unflattens (or views) an activation's last
    axis into ``(n, m, ...)`` keeping its other axes; else None."""
    p = packet(node.target)
    if p not in (aten.unflatten, aten.view, aten.reshape, aten._unsafe_view) or not node.args:
        return None
    x = node.args[0]
    xa, xs, os_ = an.axes_of(x), an.shape_of(x), an.shape_of(node)
    if xa is None or xs is None or os_ is None or an.origin_of(x) != "act" or len(os_) < len(xs) + 1:
        return None
    lead = len(xs) - 1
    if list(os_[:lead]) != list(xs[:lead]) or int(torch.tensor(os_[lead:]).prod()) != xs[-1]:
        return None
    n, ms = int(os_[lead]), [int(m) for m in os_[lead + 1:]]
    return (x, xa, n, ms) if n > 1 and all(m > 1 for m in ms) else None


def _chain(node, stop):
    out, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in out or n in stop:
            continue
        out.add(n)
        stack += list(n.users)
    return out
