"""Rules for elementwise ops: every output axis is the broadcast of the inputs' axes.

What an op allows along its channel axes follows from one identity each:
linear ops commute with any linear map; positively homogeneous ops (relu) with positive
scaled permutations; odd ops (tanh) with signed permutations; every other elementwise
function only with permutations.
"""
from __future__ import annotations

import torch

from ..registry import Meet, Unify, broadcast, register

__all__: list = []  # rule file: its rules register themselves on import

aten = torch.ops.aten


def _same(ctx):
    x = ctx.arg(0)
    return [Unify(o, a) for o, a in zip(ctx.out, ctx.axes(x))]


def _unary(kind):
    def rule(ctx):
        cons = _same(ctx)
        if kind is not None:
            cons += [Meet(o, kind, f"{ctx.where}: {ctx.node.target} is elementwise nonlinear")
                     for o, s in zip(ctx.out, ctx.out_shape) if s > 1]
        return cons
    return rule


# Linear (or identity) in their input: f(a x + b y) = a f(x) + b f(y).
LINEAR_UNARY = [
    aten.clone, aten.alias, aten.detach, aten.contiguous, aten.neg, aten.positive,
    aten.lift_fresh_copy, aten._to_copy, aten.to.dtype, aten.to.dtype_layout, aten.to.device,
    aten.to.other, aten.type_as, aten.real, aten.resolve_conj, aten.resolve_neg,
    aten.conj_physical,
]
_linear_unary = _unary(None)


def _casts_to_integer(ctx):
    """A cast from floating point to an integer or bool dtype rounds: elementwise nonlinear."""
    x, out = ctx.arg(0), ctx.node.meta.get("val")
    src = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    return (isinstance(src, torch.Tensor) and isinstance(out, torch.Tensor)
            and src.is_floating_point() and not (out.is_floating_point() or out.is_complex()))


@register(LINEAR_UNARY)
def linear_unary(ctx):
    cons = _linear_unary(ctx)
    if _casts_to_integer(ctx):
        cons += [Meet(o, "perm", f"{ctx.where}: cast to an integer dtype rounds")
                 for o, s in zip(ctx.out, ctx.out_shape) if s > 1]
    return cons


@register(aten.copy)
def copy(ctx):
    # copy(dst, src) (functionalised ``dst.copy_(src)``) has src's values, broadcast to dst's
    # shape; dst only gives the shape.
    return broadcast(ctx.out, ctx.out_shape, [ctx.arg(1)], ctx, on_broadcast="perm")


@register(aten.copy_)
def copy_(ctx):
    # dst.copy_(src) in place (shift_tokens_right writes ids this way): dst's later readers see
    # src's values, so dst, src and the result transform alike.
    return broadcast(ctx.out, ctx.out_shape, [ctx.arg(0), ctx.arg(1)], ctx, on_broadcast="perm")

# Positively homogeneous: f(c x) = c f(x) for c > 0.
register([aten.relu, aten.leaky_relu], observe=[aten.relu])(_unary("scaled_perm"))

# Odd: f(-x) = -f(x).
register([aten.tanh, aten.erf, aten.sin, aten.sinh, aten.asinh, aten.atan, aten.arctan,
          aten.sign, aten.erfinv, aten.tan, aten.asin], observe=[aten.tanh])(_unary("signed_perm"))

# Everything else elementwise: only coordinate permutations commute with it.
register([
    aten.gelu, aten.silu, aten.sigmoid, aten.exp, aten.exp2, aten.expm1, aten.log, aten.log1p,
    aten.log2, aten.rsqrt, aten.sqrt, aten.reciprocal, aten.pow.Tensor_Scalar, aten.square,
    aten.abs, aten.softplus, aten.mish, aten.hardswish, aten.hardsigmoid, aten.elu, aten.selu,
    aten.celu, aten.relu6, aten.hardtanh, aten.clamp, aten.clamp_min, aten.clamp_max, aten.cos,
    aten.cosh, aten.logical_not, aten.bitwise_not, aten.isnan, aten.isinf, aten.glu_backward,
    aten.logit, aten.floor, aten.ceil, aten.round, aten.trunc, aten.frac, aten.sgn,
    aten.ne.Scalar, aten.eq.Scalar, aten.lt.Scalar, aten.le.Scalar, aten.gt.Scalar,
    aten.ge.Scalar, aten.nan_to_num, aten.fill.Scalar,
], observe=[aten.gelu, aten.silu, aten.sigmoid])(_unary("perm"))


@register([aten.dropout, aten.feature_dropout, aten.alpha_dropout])
def dropout(ctx):
    train = ctx.arg(2, "train", False)
    if train:
        return [Meet(o, "identity", f"{ctx.where}: dropout in training mode is random")
                for o in ctx.out] + [Meet(a, "identity", f"{ctx.where}: dropout in training mode")
                                     for a in ctx.axes(ctx.arg(0))]
    return _same(ctx)


def _is_scalar(ctx, v):
    """A Python number or a 0-d tensor: scales every coordinate alike."""
    if not isinstance(v, torch.fx.Node):
        return True
    shape = ctx.shape(v)
    return shape is not None and all(s == 1 for s in shape)


@register([aten.add.Tensor, aten.sub.Tensor, aten.add.Scalar, aten.sub.Scalar, aten.rsub.Tensor,
           aten.rsub.Scalar, aten.add_.Tensor, aten.sub_.Tensor], observe=[aten.add])
def add(ctx):
    # a + b: both sides take the same map. A constant shift c·1 commutes only with maps that
    # fix the all-ones vector: among our groups, permutations.
    a, b = ctx.arg(0), ctx.arg(1)
    cons = broadcast(ctx.out, ctx.out_shape, [a, b], ctx, on_broadcast="perm")
    if _is_scalar(ctx, a) or _is_scalar(ctx, b):
        cons += [Meet(o, "perm", f"{ctx.where}: shift by a constant")
                 for o, s in zip(ctx.out, ctx.out_shape) if s > 1]
    return cons


def _varying(ctx, v, o_idx):
    """Does operand ``v`` vary along output axis ``o_idx`` (i.e. is it not broadcast there)?"""
    shape = ctx.shape(v)
    if shape is None:
        return False
    k = o_idx - (len(ctx.out_shape) - len(shape))
    return k >= 0 and shape[k] == ctx.out_shape[o_idx] and shape[k] > 1


@register([aten.mul.Tensor, aten.mul.Scalar, aten.mul_.Tensor], observe=[aten.mul])
def mul(ctx):
    # x * s with s constant along an axis is linear along that axis; x * y with both varying
    # along it is an elementwise product: (g x) ⊙ (g y) = g (x ⊙ y) only for permutations.
    a, b = ctx.arg(0), ctx.arg(1)
    if _is_scalar(ctx, b):
        return broadcast(ctx.out, ctx.out_shape, [a], ctx)
    if _is_scalar(ctx, a):
        return broadcast(ctx.out, ctx.out_shape, [b], ctx)
    cons = broadcast(ctx.out, ctx.out_shape, [a, b], ctx)
    for o in range(len(ctx.out)):
        if _varying(ctx, a, o) and _varying(ctx, b, o):
            cons.append(Meet(ctx.out[o], "perm", f"{ctx.where}: elementwise product"))
    return cons


@register([aten.div.Tensor, aten.div.Scalar, aten.div.Tensor_mode, aten.div.Scalar_mode])
def div(ctx):
    a, b = ctx.arg(0), ctx.arg(1)
    if ctx.arg(2, "rounding_mode") is not None:  # floor/trunc division: elementwise nonlinear
        return _nonlinear_nary(ctx)
    if _is_scalar(ctx, b):
        return broadcast(ctx.out, ctx.out_shape, [a], ctx)
    cons = broadcast(ctx.out, ctx.out_shape, [a, b], ctx)
    for o in range(len(ctx.out)):
        if _varying(ctx, b, o):  # 1/b is nonlinear in b
            cons.append(Meet(ctx.out[o], "perm", f"{ctx.where}: division by a varying tensor"))
    return cons


@register([aten.where.self])
def where(ctx):
    """``where(c, a, b)``: along an axis the condition is broadcast on (a mask of positions set
    for every channel: DINOv2's mask token put in place of masked patches) each position takes
    ``a``'s vector or ``b``'s whole, so a map both take commutes with it; along an axis the
    condition varies on, or with a value that is no tensor, it is elementwise nonlinear."""
    c, a, b = ctx.arg(0), ctx.arg(1), ctx.arg(2)
    if not all(isinstance(v, torch.fx.Node) for v in (c, a, b)):
        return _nonlinear_nary(ctx)
    cons = broadcast(ctx.out, ctx.out_shape, [a, b], ctx, on_broadcast="perm")
    cons += broadcast(ctx.out, ctx.out_shape, [c], ctx)
    cons += [Meet(o, "perm", f"{ctx.where}: a condition varying along this axis")
             for i, (o, s) in enumerate(zip(ctx.out, ctx.out_shape)) if s > 1 and _varying(ctx, c, i)]
    return cons


def _nonlinear_nary(ctx):
    tensors = [v for v in ctx.args if isinstance(v, torch.fx.Node)]
    cons = broadcast(ctx.out, ctx.out_shape, tensors, ctx, on_broadcast="perm")
    cons += [Meet(o, "perm", f"{ctx.where}: {ctx.node.target} is elementwise nonlinear")
             for o, s in zip(ctx.out, ctx.out_shape) if s > 1]
    return cons


register([
    aten.maximum, aten.minimum, aten.pow.Tensor_Tensor, aten.masked_fill.Scalar,
    aten.masked_fill.Tensor, aten.eq.Tensor, aten.ne.Tensor, aten.lt.Tensor, aten.le.Tensor,
    aten.gt.Tensor, aten.ge.Tensor, aten.logical_and, aten.logical_or, aten.logical_xor,
    aten.bitwise_and.Tensor, aten.bitwise_or.Tensor, aten.__and__.Tensor, aten.__or__.Tensor,
    aten.atan2, aten.fmod.Tensor, aten.remainder.Tensor, aten.lerp.Scalar, aten.clamp.Tensor,
])(_nonlinear_nary)
