"""Rules for reductions and normalisations over an axis.

Sums, means, maxima and variances over an axis are invariant under permuting it (and under
nothing larger among our groups once means are subtracted or maxima taken), so the reduced axis
meets ``perm``. Other axes pass through, and elements of their classes may not vary along the
reduced axis (the reduction mixes those entries).
"""
from __future__ import annotations

import torch

from ..registry import Meet, NoFiber, Structure, Unify, dim, register

__all__: list = []  # rule file: its rules register themselves on import

aten = torch.ops.aten


# Reductions that are linear in their input: the kept axes may take any linear map.
_LINEAR = {aten.sum, aten.mean}


def nonlinear_others(ctx, xa, shape, reduced, what):
    """A nonlinear function of each slice along ``reduced`` (max, variance, softmax, norms) is
    an elementwise-nonlinear map along every other axis: only permutations commute with it."""
    return [Meet(xa[i], "perm", f"{ctx.where}: {what} is nonlinear along this axis")
            for i in range(len(xa)) if i not in reduced and shape[i] > 1]


def _reduce(ctx, x, dims, keepdim, out, kind="perm", what="reduction", linear=False):
    xa = ctx.axes(x)
    n = len(xa)
    dims = set(range(n)) if dims is None or len(dims) == 0 else {dim(d, n) for d in dims}
    cons, j = [], 0
    for i in range(n):
        if i in dims:
            cons.append(Meet(xa[i], kind, f"{ctx.where}: {what} over this axis"))
            if keepdim:
                j += 1
        else:
            cons.append(Unify(out[j], xa[i]))
            j += 1
    cons += [NoFiber(xa[i], xa[d], f"{what} along another axis combines its slices, which must "
                     "share one map") for i in range(n) if i not in dims for d in dims]
    if not linear:
        cons += nonlinear_others(ctx, xa, ctx.shape(x), dims, what)
    return cons


@register([aten.sum.dim_IntList, aten.mean.dim, aten.amax, aten.amin, aten.logsumexp,
           aten.prod.dim_int, aten.any.dims, aten.all.dims, aten.nansum, aten.nanmean])
def reduce_dims(ctx):
    dims = ctx.arg(1, "dim", None)
    if isinstance(dims, int):
        dims = [dims]
    return _reduce(ctx, ctx.arg(0), dims, ctx.arg(2, "keepdim", False), ctx.out,
                   linear=ctx.node.target.overloadpacket in _LINEAR)


@register([aten.var.correction, aten.std.correction, aten.var_mean.correction,
           aten.std_mean.correction])
def var(ctx):
    dims = ctx.arg(1, "dim", None)
    keep = ctx.node.kwargs.get("keepdim", False)
    out = ctx.out[0] if isinstance(ctx.out[0], list) else ctx.out
    cons = _reduce(ctx, ctx.arg(0), dims, keep, out)
    if isinstance(ctx.out[0], list):
        cons += [Unify(a, b) for a, b in zip(ctx.out[0], ctx.out[1])]
    return cons


@register([aten.max.dim, aten.min.dim])
def max_dim(ctx):
    # (values, indices): indices name positions along the axis, so the axis is fixed.
    d = ctx.arg(1)
    keep = ctx.arg(2, "keepdim", False)
    cons = _reduce(ctx, ctx.arg(0), [d], keep, ctx.out[0], kind="identity", what="arg-reduction")
    return cons + [Unify(a, b) for a, b in zip(ctx.out[0], ctx.out[1])]


@register([aten.argmax, aten.argmin])
def argmax(ctx):
    d = ctx.arg(1, "dim", None)
    return _reduce(ctx, ctx.arg(0), None if d is None else [d], ctx.arg(2, "keepdim", False),
                   ctx.out, kind="identity", what="arg-reduction")


# amax's one overload (``amax.default``) takes ``dim`` (reduce_dims); max.default is over all
@register([aten.sum.default, aten.mean.default, aten.max.default])
def reduce_all(ctx):
    return _reduce(ctx, ctx.arg(0), None, False, ctx.out,
                   linear=ctx.node.target.overloadpacket in _LINEAR)


@register([aten.linalg_vector_norm, aten.norm.ScalarOpt_dim])
def norm(ctx):
    # |x|_p of each slice: sign flips and permutations of the reduced axes keep it, and every
    # orthogonal map keeps the Euclidean norm (p = 2: ZAYA's L2-normalised queries stay open
    # to rotations, so RoPE's class survives it)
    dims = ctx.arg(2, "dim", None)
    if isinstance(dims, int):
        dims = [dims]
    p = ctx.arg(1, "ord" if ctx.node.target.overloadpacket is aten.linalg_vector_norm else "p", 2)
    kind = "orthogonal" if p is None or not isinstance(p, bool) and p == 2 else "signed_perm"
    return _reduce(ctx, ctx.arg(0), dims, ctx.arg(3, "keepdim", False), ctx.out, kind=kind,
                   what=f"{'L2' if kind == 'orthogonal' else 'vector'} norm")


@register([aten.softmax.int, aten._softmax, aten.log_softmax.int, aten._log_softmax,
           aten.special_softmax])
def softmax(ctx):
    x = ctx.arg(0)
    xa = ctx.axes(x)
    d = dim(ctx.arg(1), len(xa))
    cons = [Unify(o, a) for o, a in zip(ctx.out, xa)]
    cons.append(Meet(xa[d], "perm", f"{ctx.where}: softmax over this axis"))
    cons += nonlinear_others(ctx, xa, ctx.shape(x), {d}, "softmax")
    return cons + [NoFiber(xa[i], xa[d]) for i in range(len(xa)) if i != d]


def _norm_layer(ctx, x, normalized_ndim, params, out, unscaled="perm"):
    """A normalisation over the last ``normalized_ndim`` axes with affine ``params``. Without
    a gain over a single axis it commutes with ``unscaled`` (orthogonal maps for RMS
    normalisation, those fixing 𝟙 for LayerNorm); a gain leaves permutations."""
    xa = ctx.axes(x)
    n = len(xa)
    cons = [Unify(o, a) for o, a in zip(out, xa)]
    norm_axes = xa[n - normalized_ndim:]
    kind = unscaled if (normalized_ndim == 1 and ctx.axes(params[0]) is None) else "perm"
    for a in norm_axes:
        cons.append(Meet(a, kind, f"{ctx.where}: normalisation over this axis"))
    for p in params:
        pa = ctx.axes(p)
        if pa is not None:
            cons += [Unify(a, b) for a, b in zip(norm_axes[len(norm_axes) - len(pa):], pa)]
    cons += [NoFiber(a, b) for a in xa[: n - normalized_ndim] for b in norm_axes]
    return cons + nonlinear_others(ctx, xa, ctx.shape(x), set(range(n - normalized_ndim, n)),
                                    "normalisation")


@register(aten.layer_norm, observe=True)
def layer_norm(ctx):
    shape = ctx.arg(1)
    return _norm_layer(ctx, ctx.arg(0), len(shape), [ctx.arg(2, "weight"), ctx.arg(3, "bias")],
                       ctx.out, unscaled="orthogonal_mean")


@register(aten.native_layer_norm)
def native_layer_norm(ctx):
    shape = ctx.arg(1)
    out, mean, rstd = ctx.out
    cons = _norm_layer(ctx, ctx.arg(0), len(shape), [ctx.arg(2), ctx.arg(3)], out,
                       unscaled="orthogonal_mean")
    xa = ctx.axes(ctx.arg(0))
    for stat in (mean, rstd):
        if stat is not None:
            cons += [Unify(s, a) for s, a in zip(stat, xa[: len(xa) - len(shape)])]
    return cons


@register(aten.rms_norm)
def rms_norm(ctx):
    shape = ctx.arg(1)
    return _norm_layer(ctx, ctx.arg(0), len(shape), [ctx.arg(2, "weight")], ctx.out,
                       unscaled="orthogonal")


# Batch normalisation: ``(op, index of the training flag or None, True: batch statistics
# always, index of the first running statistic or None)``.
_BATCH_NORMS = [
    (aten._native_batch_norm_legit_no_training.default, None, False, 3),
    (aten._native_batch_norm_legit.default, 5, False, 3),
    (aten._native_batch_norm_legit.no_stats, None, True, None),
    (aten._native_batch_norm_legit_functional.default, 5, False, 3),
    (aten.native_batch_norm.default, 5, False, 3),
    (aten.batch_norm.default, 5, False, 3),
]
_BN = {op: rest for op, *rest in _BATCH_NORMS}


@register([op for op, *_ in _BATCH_NORMS], observe=True)
def batch_norm(ctx):
    # y[:, c] = (x[:, c] − μ_c) / σ_c · w_c + b_c: a diagonal affine map per channel (dim 1),
    # with μ, σ the running statistics (eval) or the batch's (training, or no running stats).
    # Channel permutations carry weight, bias and running statistics along: one class, perm
    # only. Every other axis sees a per-channel shift (eval) or is reduced over (batch stats).
    flag, always, stats = _BN[ctx.node.target]
    x = ctx.arg(0)
    xa, shape = ctx.axes(x), ctx.shape(x)
    batch = always or (flag is not None and bool(ctx.arg(flag, "training", False)))
    outs = ctx.out if isinstance(ctx.out[0], list) else [ctx.out]
    c = xa[1]
    cons = [Unify(o, a) for o, a in zip(outs[0], xa)]
    cons.append(Meet(c, "perm", f"{ctx.where}: batch normalisation is a per-channel affine map"))
    tensors = [ctx.arg(1, "weight"), ctx.arg(2, "bias")]
    if stats is not None:
        tensors += [ctx.arg(stats, "running_mean"), ctx.arg(stats + 1, "running_var")]
    for t in tensors:
        if ctx.axes(t) is not None:
            cons.append(Unify(c, ctx.axes(t)[0]))
    vals = ctx.node.meta.get("val")
    for k, extra in enumerate(outs[1:], 1):  # saved / updated statistics (empty in eval)
        v = vals[k] if isinstance(vals, (list, tuple)) else None
        if extra and len(extra) == 1 and isinstance(v, torch.Tensor) and v.shape[0] == shape[1]:
            cons.append(Unify(c, extra[0]))
    what = "batch statistics over this axis" if batch else "a per-channel shift along this axis"
    others = [i for i in range(len(xa)) if i != 1]
    cons += [Meet(xa[i], "perm", f"{ctx.where}: {what}") for i in others if shape[i] > 1]
    cons += [NoFiber(xa[i], c) for i in others]
    if batch:
        cons += [NoFiber(c, xa[i]) for i in others]
    return cons


@register([aten.native_group_norm, aten.group_norm])
def group_norm(ctx):
    # Channels (dim 1) in G contiguous groups: y[:, g, j] = (x[:, g, j] − μ_g) / σ_g · w + b,
    # the statistics over a group's channels and every spatial position. Channels are the
    # product ``groups × per_group`` (as heads × head_dim): permuting whole groups moves their
    # statistics along, and permuting the channels inside one group keeps its statistics, an
    # independent permutation per group (perm(G) ≀ perm(C/G)); gains and biases are
    # covariant slots. Spatial axes are reduced over; the batch axis sees a nonlinear map.
    native = ctx.node.target.overloadpacket is aten.native_group_norm
    x = ctx.arg(0)
    groups = ctx.arg(6, "group") if native else ctx.arg(1, "num_groups")
    params = [ctx.arg(1, "weight"), ctx.arg(2, "bias")] if native else \
        [ctx.arg(2, "weight"), ctx.arg(3, "bias")]
    xa, shape = ctx.axes(x), ctx.shape(x)
    out = ctx.out[0] if native else ctx.out
    c, spatial = xa[1], list(xa[2:])
    g, inner = ctx.new_axis(groups), ctx.new_axis(shape[1] // groups)
    why = f"{ctx.where}: group normalisation"
    cons = [Unify(o, a) for o, a in zip(out, xa)]
    cons += [Structure(c, "prod", (g, inner)), Meet(g, "perm", f"{why} (groups permuted whole)"),
             Meet(inner, "perm", f"{why} (channels within a group)")]
    cons += [Unify(c, ctx.axes(p)[0]) for p in params if ctx.axes(p) is not None]
    cons += [Meet(a, "perm", f"{why}: reduced over this axis") for a, s in zip(spatial, shape[2:]) if s > 1]
    cons += [NoFiber(a, c) for a in spatial] + [NoFiber(xa[0], b) for b in [c, *spatial]]
    if shape[0] > 1:
        cons.append(Meet(xa[0], "perm", f"{why} is nonlinear along this axis"))
    for stat in (ctx.out[1:] if native else ()):  # mean and 1/σ: [N, G]
        if stat and len(stat) == 2:
            cons += [Unify(stat[0], xa[0]), Unify(stat[1], g)]
    return cons
