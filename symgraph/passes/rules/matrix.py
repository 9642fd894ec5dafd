"""Rules for contractions: linear layers, matrix products, embeddings and convolutions.

For ``y = x Wᵀ`` the contracted axes pair up dually: if ``x ↦ g x`` along its last axis then
``W ↦ W g⁻¹``, i.e. W's in-dim takes ``g^{-T}`` (contravariant). The output axis is a new
class shared with W's out-dim and the bias (covariant). Batch axes of a product of two varying
operands are independent problems: only permutations commute with them.
"""
from __future__ import annotations

import torch

from ..registry import Meet, NoFiber, Structure, Unify, broadcast, register

__all__: list = []  # rule file: its rules register themselves on import

aten = torch.ops.aten


@register(aten.linear, observe=True)
def linear(ctx):
    x, w, b = ctx.arg(0), ctx.arg(1), ctx.arg(2, "bias")
    xa, wa, out = ctx.axes(x), ctx.axes(w), ctx.out
    cons = [Unify(o, a) for o, a in zip(out[:-1], xa[:-1])]
    cons += [Unify(xa[-1], wa[-1], dual=True), Unify(out[-1], wa[0])]
    if ctx.axes(b) is not None:
        cons.append(Unify(out[-1], ctx.axes(b)[-1]))
    return cons


@register(aten.addmm, observe=True)
def addmm(ctx):
    # bias + x @ W  with W [in, out] (GPT-2's Conv1D).
    b, x, w = ctx.arg(0), ctx.arg(1), ctx.arg(2)
    xa, wa, out = ctx.axes(x), ctx.axes(w), ctx.out
    cons = [Unify(out[0], xa[0]), Unify(xa[1], wa[0], dual=True), Unify(out[1], wa[1])] + _summed(xa, wa)
    cons += broadcast(out, ctx.out_shape, [b], ctx, on_broadcast="perm")
    return cons


def _summed(a, b) -> list:
    """A product sums over the contracted axis (``a[-1]``, ``b[-2]``): a row of ``a`` or a
    column of ``b`` mixes its slices, so no element of theirs may vary along it (heads summed
    by a ``[heads, heads]`` matrix while each head's dims took a map of their own)."""
    why = "a matrix product sums over this axis"
    return [NoFiber(a[-2], a[-1], why), NoFiber(b[-1], b[-2], why)]


@register(aten.mm, observe=True)
def mm(ctx):
    a, b = ctx.axes(ctx.arg(0)), ctx.axes(ctx.arg(1))
    return [Unify(ctx.out[0], a[0]), Unify(a[1], b[0], dual=True), Unify(ctx.out[1], b[1])] + _summed(a, b)


def _batched_product(ctx, a_node, b_node):
    a, b, out = ctx.axes(a_node), ctx.axes(b_node), ctx.out
    ash, bsh = ctx.shape(a_node), ctx.shape(b_node)
    cons = [Unify(a[-1], b[-2], dual=True), Unify(out[-2], a[-2]), Unify(out[-1], b[-1])] + _summed(a, b)
    nb = len(out) - 2
    for o in range(nb):
        for axes, shape in ((a, ash), (b, bsh)):
            k = o - (nb - (len(axes) - 2))
            if k >= 0 and shape[k] == ctx.out_shape[o]:
                cons.append(Unify(out[o], axes[k]))
        if ctx.out_shape[o] > 1:
            cons.append(Meet(out[o], "perm", f"{ctx.where}: batch axis of a matrix product"))
    return cons


@register([aten.bmm, aten.matmul], observe=True)
def bmm(ctx):
    if len(ctx.shape(ctx.arg(0))) < 2 or len(ctx.shape(ctx.arg(1))) < 2:
        return None  # vector products: let the driver freeze them
    return _batched_product(ctx, ctx.arg(0), ctx.arg(1))


@register(aten.baddbmm)
def baddbmm(ctx):
    cons = _batched_product(ctx, ctx.arg(1), ctx.arg(2))
    return cons + broadcast(ctx.out, ctx.out_shape, [ctx.arg(0)], ctx, on_broadcast="perm")


@register(aten.embedding, observe=True)
def embedding(ctx):
    # out[..., :] = W[ids[...], :]: rows are picked by data, columns carry the class.
    w, ids = ctx.arg(0), ctx.arg(1)
    wa = ctx.axes(w)
    cons = [Unify(o, a) for o, a in zip(ctx.out[:-1], ctx.axes(ids))]
    cons += [Unify(ctx.out[-1], wa[1]),
             Meet(wa[0], "identity", f"{ctx.where}: embedding rows are indexed by input ids")]
    return cons


@register([aten.conv1d, aten.conv2d, aten.conv3d, aten.convolution], observe=True)
def conv(ctx):
    # Channels contract like a linear layer's; spatial axes are fixed (kernels, strides and
    # padding name positions). With ``groups`` G > 1 the weight is block diagonal: input
    # channels are ``(G, I)`` and output channels ``(G, O)`` (row-major), the weight is
    # ``[G·O, I, *k]``. A class G permutes whole groups (perm: mixing groups breaks the blocks);
    # O may take a map per group (each group's rows are its own: a product G × O, as heads ×
    # head_dim, where every tensor says which group); I takes one map for every group (the
    # weight's I axis has no G beside it). Depthwise (I = O = 1): input and output channels are
    # one class G. A transposed convolution's weight is ``[G·I, O, *k]``, its channel map per
    # group ``W_gᵀ``: the same with the weight's two channel axes swapped (I may take a map per
    # group, O one map for every group).
    x, w, b = ctx.arg(0), ctx.arg(1), ctx.arg(2, "bias")
    groups = ctx.arg(8 if ctx.node.target == aten.convolution.default else 6, "groups", 1)
    tr = ctx.node.target == aten.convolution.default and bool(ctx.arg(6, "transposed", False))
    xa, wa, out = ctx.axes(x), ctx.axes(w), ctx.out
    batched = len(xa) == len(wa)
    off = 1 if batched else 0
    cons = [Unify(out[0], xa[0])] if batched else []
    w_out, w_in = (wa[1], wa[0]) if tr else (wa[0], wa[1])
    if groups == 1:
        cons += [Unify(xa[off], w_in, dual=True), Unify(out[off], w_out)]
    else:
        wshape = ctx.shape(w)
        g = ctx.new_axis(groups)
        n_in, n_out = (wshape[0] // groups, wshape[1]) if tr else (wshape[1], wshape[0] // groups)
        i, o = ctx.new_axis(n_in), ctx.new_axis(n_out)
        whole, one = (xa[off], o) if tr else (out[off], i)
        cons += [Structure(xa[off], "prod", (g, i)), Structure(out[off], "prod", (g, o)),
                 Unify(whole, wa[0], dual=tr), Unify(one, wa[1], dual=not tr),
                 Meet(g, "perm", f"{ctx.where}: groups of a grouped convolution (permuted whole; "
                                 f"its {'outputs' if tr else 'inputs'} inside a group one map for "
                                 "every group)")]
    biased = ctx.axes(b) is not None
    if biased:
        cons.append(Unify(out[off], ctx.axes(b)[0]))
    why = f"{ctx.where}: spatial axis of a convolution"
    cons += [Meet(a, "identity", why) for a in wa[2:]]
    for d, (ia, oa) in enumerate(zip(xa[off + 1:], out[off + 1:])):
        if _pointwise(ctx, d, tr):  # one kernel position, one stride: each position alone
            cons.append(Unify(oa, ia))
            if biased:  # the bias is added at every position: a map must keep the all-ones vector
                cons.append(Meet(oa, "orthogonal_mean", f"{ctx.where}: a bias added at every "
                                                        "position of a size-1 kernel"))
        else:
            cons += [Meet(ia, "identity", why), Meet(oa, "identity", why)]
    return cons


def _pointwise(ctx, d: int, transposed: bool) -> bool:
    """Whether spatial dim ``d`` of a convolution maps each position alone: kernel size 1,
    stride 1, no padding (nor output padding), so its positions are a batch axis (a kernel-1
    ``Conv1d`` over stacked tokens: CoaT's aggregation of its three class tokens)."""
    conv = ctx.node.target == aten.convolution.default

    def at(i, name, default):
        v = ctx.arg(i, name, default)
        if isinstance(v, str):  # "valid"; "same" pads nothing where the kernel is 1
            return 0
        return v[d] if isinstance(v, (list, tuple)) else v
    ok = ctx.shape(ctx.arg(1))[2 + d] == 1 and at(3, "stride", 1) == 1 and at(4, "padding", 0) == 0
    return ok and not (conv and transposed and at(7, "output_padding", 0) != 0)
