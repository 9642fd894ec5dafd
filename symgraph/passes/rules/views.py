"""Rules for ops that move, split or merge axes without touching values.

``view``/``reshape`` split or merge dimensions: the finest common refinement of the two shapes
gives "atoms"; a dimension made of several atoms is a product class (``H*d → (H, d)`` makes the
projection width ``Prod(heads, head_dim)``). Broadcasting (``expand``) creates axes along which
values are constant: only permutations leave such an axis unchanged.
"""
from __future__ import annotations

import math

import torch

from ..registry import Meet, Structure, Unify, dim, register

__all__: list = []  # rule file: its rules register themselves on import

aten = torch.ops.aten


def refine(a_sizes, b_sizes):
    """Common refinement of two factorisations of the same number.

    Returns ``(atoms, a_parts, b_parts)`` with atom sizes and, per input factor, the indices of
    its atoms; or None when the factorisations cross (e.g. ``6x4`` vs ``4x6``).
    """
    atoms, a_parts, b_parts = [], [[] for _ in a_sizes], [[] for _ in b_sizes]
    i = j = 0
    ra, rb = (a_sizes[0] if a_sizes else 1), (b_sizes[0] if b_sizes else 1)
    while i < len(a_sizes) and j < len(b_sizes):
        lo, hi = min(ra, rb), max(ra, rb)
        if hi % lo:
            return None
        atoms.append(lo)
        a_parts[i].append(len(atoms) - 1)
        b_parts[j].append(len(atoms) - 1)
        ra //= lo
        rb //= lo
        if ra == 1:
            i += 1
            ra = a_sizes[i] if i < len(a_sizes) else 1
        if rb == 1:
            j += 1
            rb = b_sizes[j] if j < len(b_sizes) else 1
    if i != len(a_sizes) or j != len(b_sizes):
        return None
    return atoms, a_parts, b_parts


def refined_parts(ref, sides, new) -> tuple:
    """The atoms of the common refinement ``ref`` (:func:`refine`'s answer), each made by
    ``new(size)``, and every part of the two ``sides`` (the factors of each factorisation, as
    ``(axis, x)`` pairs) with the atoms it is made of: ``(atoms, [((axis, x), [atom, ...]), ...])``."""
    atoms = [new(s) for s in ref[0]]
    return atoms, [(part, [atoms[k] for k in idx]) for side, idxs in zip(sides, ref[1:])
                   for part, idx in zip(side, idxs)]


def reshape_constraints(ctx, in_axes, in_shape, out_axes, out_shape):
    ins = [(a, s) for a, s in zip(in_axes, in_shape) if s != 1]
    outs = [(a, s) for a, s in zip(out_axes, out_shape) if s != 1]
    cons = []
    i = j = 0
    while i < len(ins) and j < len(outs):
        gi, gj = [ins[i]], [outs[j]]
        i, j = i + 1, j + 1
        while math.prod(s for _, s in gi) != math.prod(s for _, s in gj):
            if math.prod(s for _, s in gi) < math.prod(s for _, s in gj):
                gi.append(ins[i]); i += 1
            else:
                gj.append(outs[j]); j += 1
        if len(gi) == 1 and len(gj) == 1:
            cons.append(Unify(gi[0][0], gj[0][0]))
            continue
        ref = refine([s for _, s in gi], [s for _, s in gj])
        if ref is None:
            why = f"{ctx.where}: reshape mixes axes {[s for _, s in gi]} -> {[s for _, s in gj]}"
            cons += [Meet(a, "identity", why) for a, _ in gi + gj]
            continue
        for (axis, _), of in refined_parts(ref, (gi, gj), ctx.new_axis)[1]:
            cons.append(Unify(axis, of[0]) if len(of) == 1 else Structure(axis, "prod", tuple(of)))
    return cons


@register([aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten,
           aten.view_copy, aten._reshape_alias, aten.squeeze, aten.unsqueeze, aten.squeeze_copy,
           aten.unsqueeze_copy, aten.view_as, aten.reshape_as])
def view(ctx):
    # ``x.view_as(y)`` / ``x.reshape_as(y)`` are ``x`` reshaped to ``y``'s shape: ``y`` gives
    # only the shape (its values are not read), so its axes are not related to the output
    x = ctx.arg(0)
    return reshape_constraints(ctx, ctx.axes(x), ctx.shape(x), ctx.out, ctx.out_shape)


@register([aten.permute, aten.permute_copy])
def permute(ctx):
    xa = ctx.axes(ctx.arg(0))
    dims = [dim(d, len(xa)) for d in ctx.arg(1)]
    return [Unify(ctx.out[i], xa[d]) for i, d in enumerate(dims)]


@register([aten.transpose, aten.transpose_copy, aten.swapaxes, aten.swapdims])
def transpose(ctx):
    xa = list(ctx.axes(ctx.arg(0)))
    if len(xa) == 0:
        return []
    d0, d1 = dim(ctx.arg(1), len(xa)), dim(ctx.arg(2), len(xa))
    xa[d0], xa[d1] = xa[d1], xa[d0]
    return [Unify(o, a) for o, a in zip(ctx.out, xa)]


@register([aten.t, aten.numpy_T])
def t(ctx):
    xa = ctx.axes(ctx.arg(0))
    return [Unify(o, a) for o, a in zip(ctx.out, reversed(xa))]


@register([aten.expand, aten.expand_copy, aten.expand_as, aten.broadcast_to])
def expand(ctx):
    x = ctx.arg(0)
    xa, xs = ctx.axes(x), ctx.shape(x)
    out, os = ctx.out, ctx.out_shape
    off = len(out) - len(xa)
    cons = []
    for o in range(len(out)):
        k = o - off
        if k >= 0 and xs[k] == os[o]:
            cons.append(Unify(out[o], xa[k]))
        elif os[o] > 1:
            cons.append(Meet(out[o], "perm", f"{ctx.where}: broadcast (expanded) axis"))
    return cons


#: Most copies :func:`repeat` writes as a concatenation (beyond: a product with a fixed factor).
MAX_COPIES = 64


def _count(r) -> int | None:
    """A repeat count as a number; None where the trace leaves it a value of the graph."""
    try:
        return int(r)
    except (TypeError, ValueError, RuntimeError):
        return None


@register(aten.repeat)
def repeat(ctx):
    """``x.repeat(r_0, ..., r_k)``: along each dim, ``r`` copies of ``x`` one after the other,
    a concatenation ``x ⊕ x ⊕ ...`` (:func:`cat`'s structure, every segment ``x``'s class:
    the map on ``x`` applied to each copy); ``r`` copies of a dim of size 1, or new leading
    dims, are broadcasts (values constant along them), as :func:`expand`'s."""
    x = ctx.arg(0)
    xa, xs = ctx.axes(x), ctx.shape(x)
    out, reps = ctx.out, [_count(r) for r in ctx.arg(1)]
    off, why = len(out) - len(xa), f"{ctx.where}: repeated (broadcast) axis"
    cons: list = []
    for o, r in enumerate(reps):
        k = o - off
        if r is None:  # a count the program computes (a graph value): copies of unknown number
            fixed = f"{ctx.where}: a number of copies the program computes"
            cons += [Meet(out[o], "identity", fixed)] + ([Meet(xa[k], "identity", fixed)] if k >= 0 else [])
        elif k >= 0 and r == 1:
            cons.append(Unify(out[o], xa[k]))
        elif k < 0 or xs[k] == 1:
            cons.append(Meet(out[o], "perm", why))
        elif r <= MAX_COPIES:
            cons.append(Structure(out[o], "sum", (xa[k],) * r))
        else:  # one copy per coordinate of a fixed outer factor
            copies = ctx.new_axis(r)
            cons += [Structure(out[o], "prod", (copies, xa[k])),
                     Meet(copies, "identity", f"{ctx.where}: {r} copies")]
    return cons


# A complex tensor ``z[..., n]`` is the real ``x[..., n, 2]`` (real and imaginary parts): a
# real map on any axis but that last one acts on both parts alike, so the other axes are
# shared; the (re, im) axis itself stays fixed. Complex RoPE (``view_as_real(view_as_complex(
# x) * c)``) is read whole by the RoPE pattern; these rules cover every other use.
@register([aten.view_as_complex, aten.view_as_complex_copy])
def view_as_complex(ctx):
    xa = ctx.axes(ctx.arg(0))
    why = f"{ctx.where}: real and imaginary parts"
    return [Unify(o, a) for o, a in zip(ctx.out, xa[:-1])] + [Meet(xa[-1], "identity", why)]


@register([aten.view_as_real, aten.view_as_real_copy])
def view_as_real(ctx):
    xa = ctx.axes(ctx.arg(0))
    why = f"{ctx.where}: real and imaginary parts"
    return [Unify(o, a) for o, a in zip(ctx.out[:-1], xa)] + [Meet(ctx.out[-1], "identity", why)]


def _strided_axes(val, size, stride, offset) -> dict:
    """``{output axis: input axis}`` of :func:`as_strided` on a contiguous ``val``: an output
    axis with the size and stride of the outermost input axis when every other output axis
    (with the offset) stays inside one of its rows; one with stride 1 and the size of the
    innermost when every other stride and the offset are multiples of that size."""
    xs = tuple(val.shape)
    if len(xs) < 2 or not val.is_contiguous() or val.storage_offset() != 0 or min(stride, default=0) < 0:
        return {}
    outer, inner = math.prod(xs[1:]), xs[-1]
    kept: dict = {}
    for j, (n, s) in enumerate(zip(size, stride)):
        reach = offset + sum((m - 1) * t for k, (m, t) in enumerate(zip(size, stride)) if k != j)
        if 0 not in kept.values() and n == xs[0] > 1 and s == outer and reach < outer:
            kept[j] = 0
        elif len(xs) - 1 not in kept.values() and n == inner > 1 and s == 1 and offset % inner == 0 \
                and all(t % inner == 0 for k, t in enumerate(stride) if k != j and size[k] > 1):
            kept[j] = len(xs) - 1
    return kept


@register([aten.as_strided, aten.as_strided_copy])
def as_strided(ctx):
    """``x.as_strided(size, stride, offset)``, windows of ``x``'s storage (Longformer's
    overlapping chunks of the sequence): the outermost and innermost axes of a contiguous ``x``
    pass through where the windows keep them whole (:func:`_strided_axes`: a map of those axes
    moves whole rows, or the same coordinate of every row); every other axis is fixed."""
    x = ctx.arg(0)
    xa, val = ctx.axes(x), x.meta.get("val")
    size, stride = [int(s) for s in ctx.arg(1)], [int(s) for s in ctx.arg(2)]
    offset = int(ctx.arg(3) or 0) if len(ctx.args) > 3 else 0
    kept = _strided_axes(val, size, stride, offset) if isinstance(val, torch.Tensor) else {}
    why = f"{ctx.where}: windows of the storage"
    cons: list = [Unify(ctx.out[j], xa[k]) for j, k in kept.items()]
    cons += [Meet(ctx.out[j], "identity", why) for j in range(len(size)) if j not in kept]
    return cons + [Meet(xa[k], "identity", why) for k in range(len(xa)) if k not in kept.values()]
