"""Rule for ``scaled_dot_product_attention``.

``softmax(q kᵀ / √d) v`` per batch/head: the head axes are independent problems (perm); q and
k contract over the head dimension, so ``q ↦ A q, k ↦ A^{-T} k`` (any invertible A, per head)
leaves the scores unchanged; v's head dimension passes to the output untouched; the rows of q
and of k (with v's) may only be permuted (the softmax of each row is nonlinear). With
``enable_gqa`` the query heads are ``Prod(kv_heads, group)``.
"""
from __future__ import annotations

import torch

from ..registry import Meet, Structure, Unify, register

__all__: list = []  # rule file: its rules register themselves on import

aten = torch.ops.aten


@register(aten.scaled_dot_product_attention, observe=True)
def sdpa(ctx):
    q, k, v = ctx.arg(0), ctx.arg(1), ctx.arg(2)
    mask = ctx.arg(3, "attn_mask")
    gqa = ctx.node.kwargs.get("enable_gqa", False) or ctx.arg(7, default=False)
    qa, ka, va, out = ctx.axes(q), ctx.axes(k), ctx.axes(v), ctx.out
    qs, ks, vs, outs = ctx.shape(q), ctx.shape(k), ctx.shape(v), ctx.out_shape
    nb = len(out) - 2
    cons = []
    for o in range(nb):
        if qs[o] == outs[o]:  # else a query of one row broadcast over the keys' batch (a Q-Former's
            cons.append(Unify(out[o], qa[o]))  # learned queries): one element, nothing to move
        for axes, shape in ((ka, ks), (va, vs)):
            kk = o - (nb - (len(axes) - 2))
            if kk < 0:
                continue
            if shape[kk] == outs[o]:
                cons.append(Unify(out[o], axes[kk]))
            elif gqa and o == nb - 1 and shape[kk] > 1 and qs[o] % shape[kk] == 0:
                if axes is ka:
                    rep = ctx.new_axis(qs[o] // shape[kk])
                    cons += [Structure(qa[o], "prod", (ka[kk], rep)),
                             Meet(rep, "perm", f"{ctx.where}: query heads sharing a kv head")]
                else:
                    cons.append(Unify(ka[kk - (len(ka) - len(va))], axes[kk]))
        if outs[o] > 1:
            cons.append(Meet(out[o], "perm", f"{ctx.where}: attention batch/head axis"))
    cons += [Unify(qa[-1], ka[-1], dual=True), Unify(ka[-2], va[-2]),
             Meet(ka[-2], "perm", f"{ctx.where}: softmax over keys"),
             Unify(out[-2], qa[-2]), Unify(out[-1], va[-1])]
    if qs[-2] > 1:  # each query row's softmax is its own: rows may only be permuted (a channel
        # axis attended over, DaViT's channel attention in Florence 2, is no token axis)
        cons.append(Meet(qa[-2], "perm", f"{ctx.where}: softmax per query row"))
    ma, ms = ctx.axes(mask), ctx.shape(mask)
    if ma is not None:
        full = list(out[:-1]) + [ka[-2]]
        sizes = list(ctx.out_shape[:-1]) + [ks[-2]]
        off = len(full) - len(ma)
        for j, (a, s) in enumerate(zip(ma, ms)):
            if s == sizes[off + j]:
                cons.append(Unify(full[off + j], a))
    return cons
