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
part, a product of its own head and head-dimension axes. The count may also come after other
factors: Persimmon's ``view(b, s, H, 3, d)`` then ``select(3, i)`` makes the packed axis
``H × (d ⊕ d ⊕ d)``, one head axis (the layout moves a head's Q, K and V rows together) and a
part per entry, each fibred over the heads as a separate projection's head dimension is.
Views on the way may merge runs of axes other than the count (SAM's ``reshape(B, h·w, 3, H, d)``
of a ``(B, h, w, 3·H·d)`` projection, then ``reshape(3, B·H, h·w, d)``): an entry's merged axis
is the product of the axes it merges, its head factor its part's.
"""
from __future__ import annotations

import math
import operator

import torch

from ..nodes import packet
from ..registry import Structure, Unify, dim

__all__ = ["find_packed"]

aten = torch.ops.aten

_RELAYOUT = {aten.unsqueeze, aten.transpose, aten.permute, aten.squeeze, aten.contiguous,
             aten.clone, aten.alias}
_VIEWS = {aten.view, aten.reshape, aten._unsafe_view}


def _runs(xs, os_) -> list | None:
    """For each axis of shape ``os_``, the run of consecutive axes of ``xs`` it merges
    (``(B, h, w)`` -> ``(B, h·w)``: ``[[0], [1, 2]]``); None where it splits one, or a size is 1."""
    if any(int(v) < 2 for v in (*xs, *os_)):
        return None
    out, i = [], 0
    for o in os_:
        run: list = []
        p = 1
        while i < len(xs) and p < int(o):
            p, run, i = p * int(xs[i]), run + [i], i + 1
        if p != int(o):
            return None
        out.append(run)
    return out if i == len(xs) else None


def _merge_label(labels) -> tuple | None:
    """The label of an axis merging axes labelled ``labels``: ``("x", parts)``; None where one
    is the count or a segment (those stay axes of their own)."""
    parts: list = []
    for lab in labels:
        if lab in ("n", "seg") or lab is None:
            return None
        parts += list(lab[1]) if isinstance(lab, tuple) and lab[0] == "x" else [lab]
    return ("x", tuple(parts))


def _merged(an, labels, node):
    """The labels of a view that merges runs of consecutive axes other than the count (SAM's
    ``reshape(3, B·H, h·w, d)``), or None."""
    runs = _runs(an.shape_of(node.args[0]) or (), an.shape_of(node) or ())
    if runs is None or len(runs) == len(labels) and all(len(r) == 1 for r in runs):
        return None if runs is None else list(labels)
    out = [labels[r[0]] if len(r) == 1 else _merge_label([labels[k] for k in r]) for r in runs]
    return None if any(o is None and len(r) > 1 for o, r in zip(out, runs)) else out


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


def _ends(an, node, labels, n, out):
    """Collect ``(end node, (a, b), labels of its output)`` for every path from ``node`` to where
    it takes entries ``a..b-1`` of the ``"n"`` axis: ``select``/``unbind`` (one entry, the axis
    gone), a ``slice`` with step 1, a piece of a ``split`` or an ``index`` by a literal range
    (the axis kept, labelled ``"seg"``); False if a path does anything else."""
    from ..rules.segments import constant_range
    for u in node.users:
        p = packet(u.target)
        k = labels.index("n")
        if u.args[0] is not node:
            return False
        if p is aten.select and u.args[1] % len(labels) == k:
            e = u.args[2] % n
            out.append((u, (e, e + 1), labels[:k] + labels[k + 1:]))
        elif p is aten.unbind and (u.args[1] if len(u.args) > 1 else 0) % len(labels) == k:
            for g in u.users:
                if g.target is not operator.getitem or not isinstance(g.args[1], int):
                    return False
                out.append((g, (g.args[1], g.args[1] + 1), labels[:k] + labels[k + 1:]))
        elif p is aten.slice and len(u.args) > 1 and u.args[1] % len(labels) == k:
            a, b = (list(u.args[2:4]) + [None, None])[:2]
            step = u.args[4] if len(u.args) > 4 else 1
            a, b, _ = slice(a, b).indices(n)
            if step != 1 or a >= b:
                return False
            out.append((u, (a, b), labels[:k] + ["seg"] + labels[k + 1:]))
        elif p in (aten.split, aten.split_with_sizes) and \
                dim(u.args[2] if len(u.args) > 2 else u.kwargs.get("dim", 0), len(labels)) == k:
            # ``split([H, 1, 1], dim=-2)`` (Falcon's multi-query heads since transformers 5.25):
            # each piece a slice of its sizes' segment, the axis kept
            if not _pieces(u, n, labels, k, out):
                return False
        elif p is aten.index and len(u.args[1]) == k + 1 and all(i is None for i in u.args[1][:k]):
            seg = constant_range(an.constant_of(u.args[1][k]), n) if u.args[1][k] is not None else None
            if seg is None:
                return False
            out.append((u, seg, labels[:k] + ["seg"] + labels[k + 1:]))
        elif p in _RELAYOUT or p in _VIEWS:
            lab = _relayout(labels, u) if p in _RELAYOUT else _merged(an, labels, u)
            if lab is None or "n" not in lab or not _ends(an, u, lab, n, out):
                return False
        else:
            return False
    return True


def _pieces(split, n, labels, k, out) -> bool:
    """The ends of a ``split``/``split_with_sizes`` along the ``"n"`` axis: every use a
    ``getitem`` of one piece, which keeps the axis (labelled ``"seg"``) over its segment."""
    sizes = split.args[1]
    if isinstance(sizes, int):
        sizes = [min(sizes, n - a) for a in range(0, n, sizes)]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    for g in split.users:
        if g.target is not operator.getitem or not isinstance(g.args[1], int):
            return False
        i = g.args[1] % len(sizes)
        out.append((g, (starts[i], starts[i] + sizes[i]), labels[:k] + ["seg"] + labels[k + 1:]))
    return True


def _tiles(segs, n) -> bool:
    """Whether the distinct segments ``segs`` cover ``0..n-1`` without overlap."""
    at = 0
    for a, b in sorted(set(segs)):
        if a != at:
            return False
        at = b
    return at == n


def find_packed(an):
    """``(claimed nodes, constraints)`` for every packed projection taken apart by entry."""
    claimed, cons = set(), []
    for node in an.graph.nodes:
        if node.op != "call_function":
            continue
        split = _last_axis_split(an, node)
        if split is None:
            continue
        x, xa, factors_, lead = split
        for c in range(len(factors_) - 1):  # the count: the factor the selects take apart
            # (never the last: a split of the last factor alone is the slice rules' business)
            pre, n, ms = factors_[:c], factors_[c], factors_[c + 1:]
            labels = list(lead) + [("p", i) for i in range(c)] + ["n"] + \
                [("m", j) for j in range(len(ms))]
            ends = []
            if _ends(an, node, labels, n, ends) and _tiles([e for _, e, _ in ends], n):
                break
        else:
            continue
        kept = {}  # segment -> whether its ends keep the n axis
        if any(kept.setdefault(seg, "seg" in lab) != ("seg" in lab) for _, seg, lab in ends):
            continue  # one segment both selected and sliced: not worth the cases
        M = math.prod(ms)
        segs = sorted(kept)
        parts = {seg: an.uf.new((seg[1] - seg[0]) * M) for seg in segs}
        outer = [an.uf.new(p) for p in pre]  # factors before the count: shared by every entry
        packed = an.uf.new(n * M) if outer else xa[-1]
        if outer:
            cons.append(Structure(xa[-1], "prod", (*outer, packed)))
        cons.append(Structure(packed, "sum", tuple(parts[seg] for seg in segs)))
        factors = {}
        for seg in segs:
            f = ([an.uf.new(seg[1] - seg[0])] if kept[seg] else []) + (
                [an.uf.new(m) for m in ms] if len(ms) > 1 or kept[seg] else [parts[seg]])
            if len(f) > 1:
                cons.append(Structure(parts[seg], "prod", tuple(f)))
            elif f[0] != parts[seg]:
                cons.append(Unify(f[0], parts[seg]))
            factors[seg] = f
        for end, seg, lab in ends:
            f = factors[seg]
            for o, tag in zip(an.axes_of(end), lab):
                if isinstance(tag, tuple) and tag[0] == "x":
                    cons.append(Structure(o, "prod", tuple(_axis(t, xa, outer, f, kept[seg]) for t in tag[1])))
                elif tag == "seg":
                    cons.append(Unify(o, f[0]))
                elif isinstance(tag, tuple) and tag[0] == "p":
                    cons.append(Unify(o, outer[tag[1]]))
                elif isinstance(tag, tuple):
                    cons.append(Unify(o, f[tag[1] + (1 if kept[seg] else 0)]))
                elif tag is not None:
                    cons.append(Unify(o, xa[tag]))
            claimed.add(end)
        claimed |= _chain(node, {e for e, _, _ in ends})
    return claimed, cons


def _axis(tag, xa, outer, f, kept):
    """The axis a label names: an input axis, a factor before the count, or one after it."""
    if isinstance(tag, int):
        return xa[tag]
    return outer[tag[1]] if tag[0] == "p" else f[tag[1] + (1 if kept else 0)]


def _last_axis_split(an, node):
    """``(input, its axes, [f, ...], labels of the leading axes)`` when ``node`` unflattens (or
    views) an activation's last axis into factors ``(f, ...)``, all > 1, keeping its other axes
    or merging runs of them (SAM's ``reshape(B, h·w, 3, H, d)`` of a ``(B, h, w, 3·H·d)``
    projection: the merged axis labelled ``("x", (1, 2))``); else None."""
    p = packet(node.target)
    if p not in (aten.unflatten, aten.view, aten.reshape, aten._unsafe_view) or not node.args:
        return None
    x = node.args[0]
    xa, xs, os_ = an.axes_of(x), an.shape_of(x), an.shape_of(node)
    if xa is None or xs is None or os_ is None or an.origin_of(x) != "act" or len(os_) < len(xs) + 1:
        return None
    lead = len(xs) - 1
    if list(os_[:lead]) == list(xs[:lead]) and math.prod(os_[lead:]) == xs[-1]:
        fs = [int(f) for f in os_[lead:]]
        return (x, xa, fs, list(range(lead))) if all(f > 1 for f in fs) else None
    k = next((k for k in range(1, len(os_) - 1) if math.prod(os_[k:]) == xs[-1]), None)
    runs = _runs(xs[:lead], os_[:k]) if k is not None and lead else None
    if runs is None or any(int(f) < 2 for f in os_[k:]):
        return None
    return x, xa, [int(f) for f in os_[k:]], [r[0] if len(r) == 1 else ("x", tuple(r)) for r in runs]


def _chain(node, stop):
    out, stack = set(), [node]
    while stack:
        n = stack.pop()
        if n in out or n in stop:
            continue
        out.add(n)
        stack += list(n.users)
    return out
