"""RoPE written other ways than ``x ⊙ cos + R(x) ⊙ sin`` (:mod:`.rope` reads that one): complex
multiplication ``view_as_real(view_as_complex(x.view(..., d/2, 2)) * c)`` and concatenated
per-pair linear forms, each recognised from the ops alone; :func:`value_source`, which
reads through floating-point casts (every form sees one value whatever dtype it was cast to),
and :func:`split_part`, which reads a ``split``'s part (``x.chunk(2, -1)``) as a slice.
"""
from __future__ import annotations

import operator

import numpy as np
import torch

from ..registry import Meet, Rope, Unify
from ..nodes import ndim, op_of
from .lastaxis import MOVES, moved
from .rope_twist import cancelling

__all__ = ["complex_ropes", "linear_ropes", "split_part", "value_source"]

aten = torch.ops.aten


# Copies that keep a floating-point value (up to rounding to the new dtype): ``q.float()``
# in the rotary code of a bf16/fp16/fp64 model, ``.to(dtype)``, ``.contiguous()``.
_COPIES = {aten._to_copy, aten.to, aten.type_as, aten.clone, aten.contiguous, aten.alias,
           aten.detach, aten.lift_fresh_copy}


def _floating(node) -> bool:
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


def value_source(node):
    """``node`` with floating-point copies and casts peeled off: two nodes with one source hold
    one value, whatever dtype each was cast to. Traced outside float32, ``rotate_half(q.float())``
    and ``q.float() * cos`` cast ``q`` twice, so the rotated operand is a second copy of ``x``."""
    while (isinstance(node, torch.fx.Node) and node.op == "call_function"
           and op_of(node) in _COPIES and node.args and isinstance(node.args[0], torch.fx.Node)
           and _floating(node) and _floating(node.args[0])
           and tuple(node.meta["val"].shape) == tuple(node.args[0].meta["val"].shape)):
        node = node.args[0]
    return node


_SPLITS = {aten.split, aten.split_with_sizes, aten.split_copy, aten.split_with_sizes_copy,
           aten.unsafe_split, aten.unsafe_split_with_sizes}


def split_part(node):
    """``(split, source, start, stop)`` where ``node`` is one part of a ``split`` of
    ``source`` along its last axis (``torch.chunk``/``torch.split``: GPT-OSS's rotary takes
    the halves so), holding coordinates ``start:stop`` there; else None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function"
            and node.target is operator.getitem and len(node.args) == 2):
        return None
    sp, i = node.args
    if not (isinstance(sp, torch.fx.Node) and op_of(sp) in _SPLITS and isinstance(i, int)):
        return None
    src = sp.args[0]
    sizes = sp.args[1] if len(sp.args) > 1 else sp.kwargs.get("split_size", sp.kwargs.get("split_sizes"))
    d = sp.args[2] if len(sp.args) > 2 else sp.kwargs.get("dim", 0)
    if not isinstance(src, torch.fx.Node) or not isinstance(src.meta.get("val"), torch.Tensor) \
            or d not in (-1, ndim(src) - 1):
        return None
    n = int(src.meta["val"].shape[-1])
    if isinstance(sizes, int) and sizes > 0:
        sizes = [min(sizes, n - k) for k in range(0, n, sizes)]
    if not (isinstance(sizes, (list, tuple)) and all(isinstance(z, int) for z in sizes)
            and sum(sizes) == n and 0 <= i < len(sizes)):
        return None
    start = sum(sizes[:i])
    return sp, src, start, start + sizes[i]


# --- shared by the forms below -------------------------------------------------------------
_CHECKS = {aten._assert_tensor_metadata, aten._assert_scalar, aten._assert_async}  # read no value


def escapes(pattern, root) -> bool:
    """Whether a value inside ``pattern`` (but its root) is read outside it (a metadata check,
    as a cast leaves after it, reads none)."""
    return any(u not in pattern and op_of(u) not in _CHECKS for m in pattern - {root} for u in m.users)


def _outer_axes(x, out, consts, axes_of, shape_of):
    """Every axis but the last: the output's follow x's (right-aligned; where the tables
    broadcast x, the output axis is fixed), the constants' leading axes meet the output's."""
    xa, oa = axes_of(x), axes_of(out)
    xs, os_ = shape_of(x), shape_of(out)
    off = len(oa) - len(xa)
    new = []
    for k in range(len(oa) - 1):
        if k >= off and xs[k - off] == os_[k]:
            new.append(Unify(oa[k], xa[k - off]))
        else:
            new.append(Meet(oa[k], "identity", f"{out.name}: rotary tables broadcast x"))
    for c in consts:
        ca, cs = axes_of(c), shape_of(c)
        coff = len(oa) - len(ca)
        new += [Unify(oa[coff + k], a) for k, a in enumerate(ca[:-1])
                if coff + k >= 0 and cs[k] == os_[coff + k]]
    return new


def _const_operand(node, origin):
    """mul/div(a, b) → (varying operand, constant operand: a node or a number), or None."""
    a, b = node.args[:2]
    an, bn = (isinstance(v, torch.fx.Node) for v in (a, b))
    if an and (not bn or origin(b) == "const") and origin(a) != "const":
        return a, b
    if bn and op_of(node) == aten.mul and (not an or origin(a) == "const") and origin(b) != "const":
        return b, a
    return None


# --- complex multiplication: view_as_real(view_as_complex(x.view(..., d/2, 2)) * c) ----------
def complex_ropes(graph, origin, axes_of, shape_of, claimed):
    """``view_as_real(view_as_complex(x.reshape(..., d/2, 2)) * c).flatten(-2)`` (Llama 4,
    DeepSeek-V2): coordinate pair ``(2i, 2i+1)`` of ``x`` is the complex number ``z_i``, and
    multiplying it by the constant ``c_i`` is the 2×2 block ``[[Re c, -Im c], [Im c, Re c]]``,
    which commutes with every rotation (and scaling) of the pair, whatever ``c`` is. So the
    output is ``x``'s layout, with rope pairs ``(2i, 2i+1)``. Read from the ops, not names."""
    for node in graph.nodes:
        if node.op != "call_function" or op_of(node) != aten.view_as_real or node in claimed:
            continue
        inner, consts, m = {node}, [], node.args[0]
        while isinstance(m, torch.fx.Node) and op_of(m) in (aten.mul, aten.div) and m not in claimed:
            split = _const_operand(m, origin)
            if split is None:
                break
            inner.add(m)
            m, c = split
            if isinstance(c, torch.fx.Node):
                consts.append(c)
        if not (isinstance(m, torch.fx.Node) and op_of(m) == aten.view_as_complex and m not in claimed):
            continue
        y = m.args[0]
        if not (isinstance(y, torch.fx.Node) and op_of(y) in (aten.view, aten.reshape, aten._unsafe_view)):
            continue
        x = y.args[0]
        xs, ys = shape_of(x), shape_of(y)
        if xs is None or ys is None or not _floating(x) or origin(x) == "const" or x.meta["val"].is_complex():
            continue
        n = xs[-1] if xs else 0
        if n < 2 or n % 2 or ys != xs[:-1] + (n // 2, 2):
            continue
        users = list(node.users)
        if len(users) != 1 or op_of(users[0]) not in (aten.view, aten.reshape, aten._unsafe_view, aten.flatten):
            continue
        out = users[0]
        rs, os_ = shape_of(node), shape_of(out)
        if os_ != rs[:-2] + (n,) or len(os_) != len(xs):
            continue
        pattern = inner | {m, y, out}
        if escapes(pattern, out) or pattern & claimed:
            continue
        new = _outer_axes(x, out, consts, axes_of, shape_of)
        new += [Unify(axes_of(out)[-1], axes_of(x)[-1]),
                Rope(axes_of(x)[-1], tuple((2 * i, 2 * i + 1) for i in range(n // 2)))]
        yield pattern, new


# --- concatenated per-pair linear forms: cat([x₀ c - x₁ s, x₁ c + x₀ s]) --------------------
def _coef_mul(coef, f):
    return tuple(sorted((sg, tuple(sorted(fs + (f,)))) for sg, fs in coef))


def _coef_neg(coef):
    return tuple(sorted((-sg, fs) for sg, fs in coef))


def _form_add(a, b, sign=1):
    out = dict(a)
    for k, c in b.items():
        c = c if sign > 0 else _coef_neg(c)
        out[k] = tuple(sorted(out.get(k, ()) + c))
    return out


def _factors(c, n, ids):
    """Per coordinate of a last axis of length ``n``, an id of constant ``c``'s value there
    (equal ids: equal values at every position, by construction), or None."""
    if not isinstance(c, torch.fx.Node):
        return [("n", float(c))] * n if isinstance(c, (int, float)) and not isinstance(c, bool) else None
    shape = c.meta["val"].shape if isinstance(c.meta.get("val"), torch.Tensor) else None
    if shape is None or c.meta["val"].is_complex():
        return None
    if len(shape) == 0 or int(shape[-1]) == 1:
        v = ids.ids(c, 1)
        return [("c", int(np.asarray(v).reshape(-1)[0]))] * n
    if int(shape[-1]) != n:
        return None
    return [("c", int(i)) for i in ids.ids(c, 1)]


class _LinearForm:
    """``node`` as a linear function of ``x``'s last-axis coordinates with constant
    coefficients: a numpy object array (over node's last axis, or its last two after a
    ``stack``) of ``{x coordinate: coefficient}``; a coefficient is a sorted tuple of
    ``(sign, factor ids)`` products (equal tuples: equal values, by construction)."""

    def __init__(self, x, origin, ids):
        self.x, self.origin, self.ids = x, origin, ids
        self.nodes, self.consts, self.memo = set(), [], {}

    def __call__(self, node):
        if node not in self.memo:
            self.memo[node] = self._eval(node)
            if self.memo[node] is not None and node is not self.x \
                    and value_source(node) is not value_source(self.x):
                self.nodes.add(node)
        return self.memo[node]

    def _eval(self, node):
        if not isinstance(node, torch.fx.Node):
            return None
        if node is self.x or value_source(node) is value_source(self.x):
            n = int(self.x.meta["val"].shape[-1])
            out = np.empty(n, dtype=object)
            for i in range(n):
                out[i] = {i: ((1, ()),)}
            return out
        if node.op != "call_function" or not _floating(node) or self.origin(node) == "const":
            return None
        part = split_part(node)
        if part is not None:  # a chunk of x's last axis: a slice (the split is in the pattern)
            v = self(part[1])
            if v is None or v.ndim != 1:
                return None
            self.nodes.add(part[0])
            return v[part[2]:part[3]]
        p = op_of(node)
        if p in _COPIES:
            return self(node.args[0])
        if p == aten.neg:
            v = self(node.args[0])
            return None if v is None else _map(v, lambda f: {k: _coef_neg(c) for k, c in f.items()})
        if p in MOVES:  # slices, concatenations, stacks, unsqueezes and reshapes of the last axis
            return moved(node, self)
        if p in (aten.mul, aten.div):
            return self._scaled(node, p == aten.div)
        if p in (aten.add, aten.sub):
            if node.kwargs.get("alpha", 1) != 1 or len(node.args) > 2:
                return None
            a, b = (self(t) for t in node.args[:2])
            if a is None or b is None or a.ndim != 1 or a.shape != b.shape:
                return None
            sign = -1 if p == aten.sub else 1
            out = np.empty(len(a), dtype=object)
            for i in range(len(a)):
                out[i] = _form_add(a[i], b[i], sign)
            return out
        return None

    def _scaled(self, node, inv):
        """A product (a quotient when ``inv``) with a constant: each coefficient times the
        constant's factor at its coordinate."""
        split = _const_operand(node, self.origin)
        if split is None:
            return None
        a, c = split
        v = self(a)
        if v is None or v.ndim != 1:
            return None
        fs = _factors(c, len(v), self.ids)
        if fs is None:
            return None
        if isinstance(c, torch.fx.Node):
            self.consts.append(c)
        out = np.empty(len(v), dtype=object)
        for i, (f, fac) in enumerate(zip(v, fs)):
            fac = ("inv",) + fac if inv else fac
            out[i] = {k: _coef_mul(cf, fac) for k, cf in f.items()}
        return out


def _map(v, fn):
    out = np.empty(v.shape, dtype=object)
    for idx in np.ndindex(v.shape):
        out[idx] = fn(v[idx])
    return out


def _source(root, origin):
    """The one activation a candidate root is computed from through the ops
    :class:`_LinearForm` reads (copies peeled off), or None. Parts of one ``split`` along the
    last axis (``x.chunk(2, -1)``) come from the split's input; one part alone is its own
    source (a partial rotary's ``q_rot`` of ``torch.split(q, [nope, rot], -1)``)."""
    seen, leaves, stack = set(), set(), [root]
    readable = {aten.neg, aten.slice, aten.cat, aten.stack, aten.unsqueeze, aten.view,
                aten.reshape, aten.flatten, aten._unsafe_view, aten.mul, aten.div, aten.add,
                aten.sub} | _COPIES

    def whole(leaf):  # the split a part belongs to: parts of one split are one source
        part = split_part(leaf)
        return leaf if part is None else part[0]

    while stack and len({whole(v) for v in leaves}) < 2 and len(seen) < 256:
        n = stack.pop()
        if n in seen or not isinstance(n, torch.fx.Node) or origin(n) == "const":
            continue
        seen.add(n)
        src = value_source(n)
        if src is not n:
            leaves.add(src)
            continue
        if n.op == "call_function" and op_of(n) in readable and _reads_last(n):
            stack += [a for a in _flat(n.args) if isinstance(a, torch.fx.Node)]
        else:
            leaves.add(n)
    if stack or len({whole(v) for v in leaves}) != 1:
        return None
    if len(leaves) == 1:
        return next(iter(leaves))
    src = split_part(next(iter(leaves)))[1]
    return None if origin(src) == "const" else value_source(src)


def _reads_last(node) -> bool:
    """Whether :class:`_LinearForm` can follow ``node``'s last axis back to its input's: views
    only where they merge a ``stack``'s last two axes or change nothing, slices, concatenations
    and unsqueezes only along the last axis (anything else makes it a leaf)."""
    p, nd = op_of(node), ndim(node)
    shape = lambda n: tuple(n.meta["val"].shape)  # noqa: E731
    if p in (aten.view, aten.reshape, aten.flatten, aten._unsafe_view):
        src = node.args[0]
        if not isinstance(src, torch.fx.Node) or not isinstance(src.meta.get("val"), torch.Tensor):
            return False
        i, o = shape(src), shape(node)
        return i == o or (len(i) >= 2 and i[:-2] == o[:-1] and o[-1] == i[-2] * i[-1])
    if p in (aten.slice, aten.cat, aten.stack, aten.unsqueeze):
        d = node.args[1] if len(node.args) > 1 else 0
        return d in (-1, nd - 1)
    return True


def _flat(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _flat(a)
        else:
            yield a


def _pair_blocks(forms, n):
    """``[((a, b), (oa, ob))]``: output ``oa`` ⊕ ``ob`` is ``[[α, -β], [β, α]]`` applied to
    ``x_a`` ⊕ ``x_b`` (α, β constants equal by construction), pairs partitioning x's
    coordinates; else None."""
    if len(forms) != n:
        return None
    by_pair: dict = {}
    for o, f in enumerate(forms):
        if len(f) != 2:
            return None
        by_pair.setdefault(tuple(sorted(f)), []).append(o)
    if sorted(i for pr in by_pair for i in pr) != list(range(n)):
        return None
    blocks = []
    for (a, b), outs in by_pair.items():
        if len(outs) != 2:
            return None
        for oa, ob in (outs, outs[::-1]):
            fa, fb = forms[oa], forms[ob]
            if fa[a] == fb[b] and fa[b] == _coef_neg(fb[a]):
                blocks.append(((a, b), (oa, ob)))
                break
        else:
            return None
    return sorted(blocks)


def linear_ropes(graph, origin, axes_of, shape_of, claimed, ids, unobservable):
    """A concatenation along the last axis whose every coordinate pair is a scaled rotation
    ``[[α, -β], [β, α]]`` of the same pair of ``x``'s coordinates (``α``, ``β`` constants equal
    by construction): such a block commutes with every rotation and scaling of its pair, so
    the output is x's class with rope pairs. Where the output leaves x's layout (DeepSeek-V3's
    ``rope_interleave``, ``cat([x[0::2]·cos - x[1::2]·sin, x[1::2]·cos + x[0::2]·sin])`` moves
    pair ``p`` from ``(2p, 2p+1)`` to ``(p, p + d/2)``), the same holds only where attention
    undoes the permutation (:func:`~.rope_twist.cancelling`), whose nodes join ``unobservable``
    (activations there hold the class's coordinates permuted); elsewhere it is left to the
    rules (its pairs stay fixed)."""
    twisted: dict = {}  # outputs in another layout than x's: kept where attention undoes it
    held: set = set()
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or node in claimed or node in held \
                or op_of(node) != aten.cat or origin(node) == "const" or not _floating(node):
            continue
        x = _source(node, origin)
        if x is None or not _floating(x) or shape_of(x) is None or len(shape_of(x)) == 0:
            continue
        form = _LinearForm(x, origin, ids)
        forms = form(node)
        n = shape_of(x)[-1]
        if forms is None or forms.ndim != 1 or n % 2:
            continue
        blocks = _pair_blocks(list(forms), n)
        if blocks is None or form.nodes & (claimed | held) or escapes(form.nodes, node):
            continue
        xa, oa = axes_of(x), axes_of(node)
        new = _outer_axes(x, node, form.consts, axes_of, shape_of)
        new += [Unify(oa[-1], xa[-1]), Rope(xa[-1], tuple(pr for pr, _ in blocks))]
        if all(pr == o for pr, o in blocks):
            yield form.nodes | {node}, new
            continue
        perm = [0] * n  # x's coordinate i is the output's perm[i]
        for (a, b), (o, p) in blocks:
            perm[a], perm[b] = o, p
        twisted[node] = (form.nodes | {node}, new, tuple(perm))
        held |= form.nodes | {node}
    for node, region in cancelling([(nd, t[2]) for nd, t in twisted.items()]).items():
        unobservable |= region
        yield twisted[node][0], twisted[node][1]
