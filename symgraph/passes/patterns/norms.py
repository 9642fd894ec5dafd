"""Pattern pass: normalisations over the last axis, and norm gains folded into their readers.

RMS normalisation ``y = x · rsqrt(mean(x², -1) + ε)`` commutes with every orthogonal map of
x's last axis (it divides by a norm); LayerNorm without affine parameters,
``(x − mean x) / std x``, with the orthogonal maps that fix 𝟙 (they keep the mean). A gain
``g ⊙ y`` (a vector parameter) commutes with neither, only with permutations. But when every
path from ``g ⊙ y + β`` ends in a linear layer that reads it along that axis,
``W (g ⊙ y + β) + b = (W diag g) y + (W β + b)``: gain and shift *fold* into the readers, a
function-preserving change of the weights that keeps the architecture (``g = 1``, ``β = 0``).
The analysis describes the model with such norms folded; every transform folds first and
unfolds after (:meth:`symgraph.SymmetryReport.fold`), so the residual stream of an RMSNorm
model admits all of O(d) and a LayerNorm model the orthogonal maps that fix 𝟙.

A fold needs: the gain (and shift) used by this norm only; every reader a linear layer
(``linear``, ``addmm``, ``mm``) whose weight is used nowhere else (a head tied to the embedding
cannot absorb a gain: the stream then stays a permutation class); with a shift, every reader
has a bias used nowhere else, or the shift stays. Paths may pass through casts, eval-mode dropout, reshapes that
keep the last axis and selections along other axes. With a shift and a reader without a
bias, the shift stays on the stream as ``β / g`` (gains must then have no zero entry). A gain
read with a constant offset, ``(c + w) ⊙ y`` (Gemma's ``1 + w``), folds as ``diag(c + w)``
(:attr:`Fold.offset`). No module names are consulted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..registry import Meet, NoFiber, Unify
from ..nodes import ndim, op_of

__all__ = ["Fold", "find_norms"]

aten = torch.ops.aten

_CASTS = {aten.to, aten._to_copy, aten.clone, aten.contiguous, aten.alias, aten.detach,
          aten.type_as, aten.lift_fresh_copy}
_SKIP = {aten._assert_tensor_metadata}
_NORM_OPS = (aten.layer_norm, aten.rms_norm)  # (x, shape, weight[, bias], eps)


@dataclass(frozen=True)
class Fold:
    """A norm whose gain (and shift) fold into its readers: ``readers`` are
    ``(weight, axis of the weight that reads the stream, bias or None)``."""
    gain: str
    shift: str | None
    readers: tuple
    node: str
    keep_shift: bool = False  # the shift stays on the stream as β/g (a reader has no bias)
    offset: float = 0.0  # the gain read is the parameter plus this (Gemma's ``x · (1 + w)``: 1)

    def to_dict(self):
        return {"gain": self.gain, "shift": self.shift, "node": self.node,
                "keep_shift": self.keep_shift, "offset": self.offset,
                "readers": [[w, d, b] for w, d, b in self.readers]}


def _node(x):
    return x if isinstance(x, torch.fx.Node) else None


def _shape(node):
    v = node.meta.get("val")
    return tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None


def _users(node):
    return [u for u in node.users if op_of(u) not in _SKIP]


def _stored(x):
    """The node ``x`` reads a stored value through: ``x`` itself, or what a chain of casts
    ending in ``x`` casts, each link read once (a router's ``weight.float()``, a no-op check
    in float32 and a copy in bfloat16: the fold is the same in every dtype)."""
    x = _node(x)
    while x is not None and op_of(x) in _CASTS and x.args and len(_users(x)) == 1:
        x = _node(x.args[0])
    return x


def _last(d, nd):
    return d in (-1, nd - 1)


def _root(r, mul):
    """``r`` is ``rsqrt(·)`` / ``·^-0.5`` (for a product) or ``sqrt(·)`` / ``·^0.5`` (for a
    quotient)."""
    p = op_of(r)
    if p is (aten.rsqrt if mul else aten.sqrt):
        return True
    return p is aten.pow and len(r.args) == 2 and r.args[1] == (-0.5 if mul else 0.5)


def _l2(r, x):
    """``r`` is ``‖x‖₂`` over the last axis, kept (``x.norm(dim=-1, keepdim=True)``)."""
    if op_of(r) is not aten.linalg_vector_norm or r.args[0] is not x:
        return False
    ordr = r.args[1] if len(r.args) > 1 else r.kwargs.get("ord", 2)
    dims = r.args[2] if len(r.args) > 2 else r.kwargs.get("dim")
    keep = r.args[3] if len(r.args) > 3 else r.kwargs.get("keepdim", False)
    return ordr == 2 and keep and isinstance(dims, (list, tuple)) and len(dims) == 1 \
        and _last(dims[0], ndim(x) or 0)


def _rms(node):
    """``(x, internal nodes)`` if ``node`` is ``x · rsqrt(mean(x², -1) + ε)`` (or
    ``x / sqrt(...)``, a sum for the mean, a power ±½ for the root, or ``x / ‖x‖₂``: L2
    normalisation, CLIP's embeddings), else None. All commute with orthogonal maps."""
    p = op_of(node)
    if p not in (aten.mul, aten.div) or len(node.args) != 2:
        return None
    a, b = node.args
    cands = [(a, b), (b, a)] if p is aten.mul else [(a, b)]
    for x, r in cands:
        x, r = _node(x), _node(r)
        if x is None or r is None or len(_users(r)) != 1:
            continue
        if p is aten.div and _l2(r, x) and _shape(x) == _shape(node):
            return x, [r]
        if not _root(r, p is aten.mul):
            continue
        inner, internal = r.args[0], [r]
        if op_of(inner) is aten.add and len(_users(inner)) == 1:
            m = [t for t in inner.args if isinstance(t, torch.fx.Node)]
            eps = [t for t in inner.args if isinstance(t, (int, float))]
            if len(m) != 1 or len(eps) != 1:
                continue
            internal.append(inner)
            inner = m[0]
        if op_of(inner) not in (aten.mean, aten.sum) or len(_users(inner)) != 1:
            continue
        dims = inner.args[1] if len(inner.args) > 1 else None
        keep = inner.args[2] if len(inner.args) > 2 else inner.kwargs.get("keepdim", False)
        sq = inner.args[0]
        if not keep or not isinstance(dims, (list, tuple)) or len(dims) != 1 \
                or not _last(dims[0], ndim(sq) or 0) or len(_users(sq)) != 1:
            continue
        ps = op_of(sq)
        if not ((ps is aten.pow and sq.args[0] is x and sq.args[1] == 2)
                or (ps is aten.mul and sq.args[0] is x and sq.args[1] is x)
                or (ps is aten.square and sq.args[0] is x)):
            continue
        if _shape(x) != _shape(node):
            continue
        return x, internal + [inner, sq]
    return None


def _transparent(u, n, d):
    """``u`` passes ``n``'s values on unchanged along the last axis (size ``d``)."""
    p = op_of(u)
    if not u.args or u.args[0] is not n or any(a is n for a in u.args[1:]):
        return False
    if p in _CASTS:
        v = u.meta.get("val")
        return isinstance(v, torch.Tensor) and v.is_floating_point()
    if p is aten.dropout:
        return (len(u.args) > 1 and u.args[1] == 0) or (len(u.args) > 2 and u.args[2] is False)
    if p in (aten.view, aten.reshape, aten._unsafe_view):
        si, so = _shape(n), _shape(u)
        return bool(si and so and si[-1] == so[-1] == d)
    if p in (aten.select, aten.slice):
        dim = u.args[1] if len(u.args) > 1 else 0
        return not _last(dim, ndim(n))
    if p is aten.unsqueeze:  # a new axis anywhere but last
        return not _last(u.args[1], ndim(n) + 1)
    if p is aten.expand:  # repeats along other axes (each token once per routed expert)
        so = _shape(u)
        return bool(so and so[-1] == d)
    return False


class _Graph:
    def __init__(self, an):
        self.an = an
        self.names = dict(an.param_of)  # placeholder name -> parameter fqn
        self.tied = {n for t in an.tied if len(t) > 1 for n in t}

    def param(self, x, dims):
        """The parameter fqn of placeholder ``x`` (``dims`` dims, used once; read directly or
        through casts), else None."""
        x = _stored(x)
        if x is None or x.op != "placeholder" or x.name not in self.names:
            return None
        name = self.names[x.name]
        if ndim(x) != dims or len(_users(x)) != 1 or name in self.tied:
            return None
        return name

    def reader(self, u, n):
        p = op_of(u)
        if p is aten.linear and u.args[0] is n:
            w = self.param(u.args[1], 2)
            b = u.args[2] if len(u.args) > 2 else u.kwargs.get("bias")
            return None if w is None else (w, 1, b, u.args[1])
        if p is aten.addmm and len(u.args) == 3 and u.args[1] is n and not u.kwargs:
            w = self.param(u.args[2], 2)
            return None if w is None else (w, 0, u.args[0], u.args[2])
        if p is aten.mm and u.args[0] is n:
            w = self.param(u.args[1], 2)
            return None if w is None else (w, 0, None, u.args[1])
        if p is aten.unsqueeze and len(u.users) == 1:
            return self.gathered_reader(u, n)
        return None

    def gathered_reader(self, u, n):
        """``bmm(W[labels], n.unsqueeze(-1))`` (or ``bmm(n.unsqueeze(1), W[labels])``): each
        row of ``n`` read by the weights its labels pick from a stacked ``W`` (mixture-of-experts
        experts; no bias)."""
        (b,) = u.users
        if op_of(b) is not aten.bmm or ndim(n) != 2:
            return None
        if _last(u.args[1], 3) and b.args[1] is u:
            sel, axis = b.args[0], 2
        elif u.args[1] in (1, -2) and b.args[0] is u:
            sel, axis = b.args[1], 1
        else:
            return None
        if sel.target is not aten.index.Tensor or len(sel.users) != 1:
            return None
        idx = sel.args[1]
        if len(idx) != 1 or idx[0] is None:
            return None
        w = self.param(sel.args[0], 3)
        return None if w is None else (w, axis, None, sel.args[0])

    def readers(self, G, d, shift):
        """Every path from ``G`` to a linear reader, or None if one goes elsewhere."""
        out, stack = [], [G]
        while stack:
            n = stack.pop()
            for u in _users(n):
                r = self.reader(u, n)
                if r is not None:
                    w, axis, b, wnode = r
                    if _shape(wnode)[axis] != d:
                        return None
                    bias = None
                    if b is not None:
                        bias = self.param(b, 1)
                        if bias is None:
                            return None
                    if shift and bias is None:
                        return None
                    out.append((w, axis, bias))
                elif _transparent(u, n, d):
                    stack.append(u)
                else:
                    return None
        return tuple(out) or None


def _gain_of_rms(y, g):
    """The node ``gain ⊙ cast(y)`` right after an RMS normalisation, and the gain."""
    n = y
    while True:
        us = _users(n)
        if len(us) != 1:
            return None
        u = us[0]
        if op_of(u) in _CASTS and u.args[0] is n:
            n = u
            continue
        if op_of(u) is aten.mul and len(u.args) == 2:
            other = u.args[1] if u.args[0] is n else (u.args[0] if u.args[1] is n else None)
            gain, offset = g.param(other, 1), 0.0
            if gain is None:
                gain, offset = _offset_gain(g, other)
            if gain is not None and _shape(u) == _shape(n):
                return u, n, other, gain, offset
        return None


def _offset_gain(g, node):
    """``(gain, c)`` if ``node`` is ``c + w`` (``w`` a vector parameter used there only, through
    floating-point casts; ``c`` a number: Gemma's ``1 + w``), else ``(None, 0.0)``."""
    node = _node(node)
    if op_of(node) is not aten.add or len(node.args) != 2 or node.kwargs or len(_users(node)) != 1:
        return None, 0.0
    a, b = node.args
    w, c = (a, b) if isinstance(b, (int, float)) and not isinstance(b, bool) else (b, a)
    if not isinstance(c, (int, float)) or isinstance(c, bool) or not isinstance(w, torch.fx.Node):
        return None, 0.0
    while op_of(w) in _CASTS and len(_users(w)) == 1 and _node(w.args[0]) is not None \
            and _transparent(w, w.args[0], 0):  # a floating-point cast (the width is not read)
        w = w.args[0]
    if w.op != "placeholder" or len(_users(w)) != 1 or ndim(w) != 1:
        return None, 0.0
    name = g.names.get(w.name)
    return (None, 0.0) if name is None or name in g.tied else (name, float(c))


def _normalised(an, x, out, kind, why):
    """``out`` has x's axes; the last axis meets ``kind``, the others permutations."""
    xa = an.axes_of(x)
    cons = [Unify(o, a) for o, a in zip(an.axes_of(out), xa)]
    cons.append(Meet(xa[-1], kind, why))
    shape = an.shape_of(x)
    for a, s in zip(xa[:-1], shape[:-1]):
        if s > 1:
            cons.append(Meet(a, "perm", f"{why}: nonlinear along this axis"))
        cons.append(NoFiber(a, xa[-1]))
    return cons


def _fixed(an, nodes, why):
    return [Meet(a, "identity", why) for n in nodes for a in an._all_axes(n)]


def find_norms(an, fold: bool = True, skip=frozenset()):
    """``(claimed nodes, constraints, folds, unobservable nodes)`` for every RMS
    normalisation and (with ``fold``) every foldable norm gain of ``an``'s graph, except the
    gain nodes named in ``skip``."""
    g = _Graph(an)
    claimed, cons, folds, hidden = set(), [], [], set()
    for node in an.graph.nodes:
        if node.op != "call_function" or an.origin_of(node) != "act":
            continue
        rms = _rms(node)
        if rms is not None:
            x, internal = rms
            where = f"{node.name}: RMS normalisation"
            claimed |= {node, *internal}
            cons += _normalised(an, x, node, "orthogonal", where)
            cons += _fixed(an, internal, f"{where} (internal)")
            hit = _gain_of_rms(node, g) if fold else None
            if hit is not None and hit[0].name in skip:
                hit = None
            if hit is not None:
                G, t, gnode, gain, offset = hit
                readers = g.readers(G, _shape(G)[-1], shift=False)
                if readers is not None:
                    claimed.add(G)
                    hidden.add(G)
                    cons += [Unify(o, a) for o, a in zip(an.axes_of(G), an.axes_of(t))]
                    cons += _fixed(an, [gnode], f"{G.name}: gain folded into its readers")
                    folds.append(Fold(gain, None, readers, G.name, offset=offset))
        elif fold and op_of(node) in _NORM_OPS and len(node.args) > 2 \
                and node.name not in skip:
            layer = op_of(node) is aten.layer_norm
            shape = node.args[1]
            w = node.args[2]
            b = node.args[3] if layer and len(node.args) > 3 else None
            gain = g.param(w, 1)
            shift = g.param(b, 1) if b is not None else None
            if len(shape) != 1 or gain is None or (b is not None and shift is None):
                continue
            readers = g.readers(node, shape[0], shift=False)
            if readers is None:
                continue
            keep = shift is not None and any(b is None for _, _, b in readers)
            what = "layer" if layer else "RMS"
            where = f"{node.name}: {what} normalisation (gain folded into its readers)"
            claimed.add(node)
            hidden.add(node)
            cons += _normalised(an, node.args[0], node, "orthogonal_mean" if layer else "orthogonal",
                                where)
            cons += _fixed(an, [w] if keep or b is None else [w, b], where)
            if keep:  # β/g is a vector on the stream
                cons.append(Unify(an.axes_of(b)[0], an.axes_of(node.args[0])[-1]))
            folds.append(Fold(gain, shift, readers, node.name, keep))
    return claimed, cons, folds, hidden
