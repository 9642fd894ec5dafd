"""Rules for ops that cut an axis into segments or pick entries of it.

``slice``/``split``/``cat`` make an axis a direct sum of segments (fused QKV projections,
``rotate_half``): a map acting block-diagonally on the segments commutes with them. Picking
single entries (``select``, ``index``) fixes the axis.
"""
from __future__ import annotations

import torch

from ..nodes import packet
from ..registry import Meet, NoFiber, Structure, Unify, dim, register

__all__: list = []  # rule file: its rules register themselves on import

aten = torch.ops.aten

_BIG = 2 ** 62


def _others(xa, out, d):
    """Unify every axis but ``d`` of input and output (which keep the same rank)."""
    return [Unify(o, a) for k, (o, a) in enumerate(zip(out, xa)) if k != d]


@register([aten.slice.Tensor, aten.slice_copy.Tensor])
def slice_(ctx):
    x = ctx.arg(0)
    xa, xs = ctx.axes(x), ctx.shape(x)
    d = dim(ctx.arg(1, "dim", 0), len(xa))
    n = xs[d]
    start = ctx.arg(2, "start", None) or 0
    end = ctx.arg(3, "end", None)
    step = ctx.arg(4, "step", 1) or 1
    if not all(isinstance(v, int) for v in (n, start, step)) or not isinstance(end, (int, type(None))):
        # bounds computed in the program (Mistral 3's image features cut at each image's
        # size): which entries are kept is unknown here, so the sliced axis is fixed
        why = f"{ctx.where}: slice with bounds computed in the program"
        return _others(xa, ctx.out, d) + [Meet(xa[d], "identity", why), Meet(ctx.out[d], "identity", why)]
    end = n if end is None or end >= _BIG else end
    start, end = (start + n if start < 0 else start), (end + n if end < 0 else end)
    start, end = max(0, min(start, n)), max(0, min(end, n))
    cons = _others(xa, ctx.out, d)
    if step == 1 and start == 0 and end == n:
        return cons + [Unify(ctx.out[d], xa[d])]
    if step != 1:
        if step > 1 and n % step == 0 and start < step and ctx.shape(ctx.node)[d] == n // step:
            # ``x[..., s::k]`` (GPT-OSS's fused experts: gate and up in alternating columns):
            # entry ``i·k + s`` is ``(i, s)`` of the row-major product ``n/k × k``; the slice
            # picks one entry ``s`` of the inner factor (fixed) and keeps the outer factor.
            # The other slices ``x[..., s'::k]`` read the same outer factor: the interleaved
            # parts share one class (a GLU's gate ⊙ up unifies them anyway).
            inner = ctx.new_axis(step)
            why = f"{ctx.where}: strided slice picks one entry of every {step}"
            return cons + [Structure(xa[d], "prod", (ctx.out[d], inner)), Meet(inner, "identity", why)]
        why = f"{ctx.where}: strided slice"
        return cons + [Meet(xa[d], "identity", why), Meet(ctx.out[d], "identity", why)]
    parts = []
    if start > 0:
        parts.append(ctx.new_axis(start))
    parts.append(ctx.out[d])
    if end < n:
        parts.append(ctx.new_axis(n - end))
    return cons + [Structure(xa[d], "sum", tuple(parts))]


@register([aten.split.Tensor, aten.split_with_sizes, aten.split_copy.Tensor,
           aten.split_with_sizes_copy])
def split(ctx):
    x = ctx.arg(0)
    xa = ctx.axes(x)
    d = dim(ctx.arg(2, "dim", 0), len(xa))
    outs = [o for o in ctx.out if o is not None]
    cons = []
    for o in outs:
        cons += _others(xa, o, d)
    if len(outs) == 1:
        return cons + [Unify(outs[0][d], xa[d])]
    return cons + [Structure(xa[d], "sum", tuple(o[d] for o in outs))]


@register([aten.cat, aten.concat, aten.concatenate], observe=[aten.cat])
def cat(ctx):
    tensors = [t for t in ctx.arg(0) if ctx.shape(t) is not None and 0 not in ctx.shape(t)]
    d = dim(ctx.arg(1, "dim", 0), len(ctx.out))
    cons = []
    for t in tensors:
        cons += _others(ctx.axes(t), ctx.out, d)
    if len(tensors) == 1:
        return cons + [Unify(ctx.out[d], ctx.axes(tensors[0])[d])]
    return cons + [Structure(ctx.out[d], "sum", tuple(ctx.axes(t)[d] for t in tensors))]


#: Ops whose result holds no values yet: what a later write leaves of it is never read.
_BLANK = {aten.empty, aten.new_empty, aten.empty_like, aten.empty_strided}


@register(aten.slice_scatter)
def slice_scatter(ctx):
    """``out = x`` with ``out[.., a:b, ..] = src`` along ``dim`` (functionalised in-place writes
    into a slice: DeepSeek's latent attention builds its keys as ``new_empty`` then
    ``key[..., :n].copy_(k_nope)``, ``key[..., n:].copy_(k_rot)``). The axis is a sum of the
    part before, ``src``'s part and the part after; the parts before and after are ``x``'s
    (``x``'s own middle part is overwritten: a free axis). Every other axis is ``src``'s and
    ``x``'s, except that an uninitialised ``x`` (``empty``: values no program may read before
    writing them) relates nothing."""
    x, src = ctx.arg(0), ctx.arg(1)
    xa, sa, xs = ctx.axes(x), ctx.axes(src), ctx.shape(x)
    if xa is None or sa is None:
        return None
    d = dim(ctx.arg(2, "dim", 0), len(xa))
    n = xs[d]
    start, end, step = ctx.arg(3, "start", None), ctx.arg(4, "end", None), ctx.arg(5, "step", 1) or 1
    start, end, _ = slice(start, None if end is None or end >= _BIG else end).indices(n)
    if step != 1 or end - start != ctx.shape(src)[d]:
        return None
    blank = isinstance(x, torch.fx.Node) and x.op == "call_function" and packet(x.target) in _BLANK
    cons = _others(sa, ctx.out, d) + ([] if blank else _others(xa, ctx.out, d))
    if start == 0 and end == n:
        return cons + [Unify(ctx.out[d], sa[d])]
    before = [ctx.new_axis(start)] if start > 0 else []
    after = [ctx.new_axis(n - end)] if end < n else []
    cons.append(Structure(ctx.out[d], "sum", tuple(before + [sa[d]] + after)))
    if not blank:
        cons.append(Structure(xa[d], "sum", tuple(before + [ctx.new_axis(end - start)] + after)))
    return cons


@register([aten.scatter.value, aten.scatter.src, aten.scatter_add, aten.scatter.value_reduce,
           aten.scatter.reduce])
def scatter(ctx):
    """``out = x`` with ``out[.., idx[.., j, ..], ..] = v`` (or ``src[.., j, ..]``, or added to)
    along ``dim``. Where ``idx`` holds labels of a class of ``x``'s size there (DeepSeek's
    group-limited routing: ``zeros.scatter_(1, top_groups, 1)``, a mask over the groups), the
    result is equivariant under relabelling that class and permuting the axis alike, so the
    axis joins the label class (a permutation class); otherwise its entries are picked by index
    values (fixed). Off ``dim``, ``out``, ``x``, ``idx`` and ``src`` share the axes of equal
    sizes; a smaller ``idx`` there writes a prefix (fixed). The slot axis ``j`` is fixed."""
    x, idx = ctx.arg(0), ctx.arg(2)
    src = ctx.arg(3) if ctx.node.target in (aten.scatter.src, aten.scatter_add.default,
                                             aten.scatter.reduce) else None
    xa, ia, xs, ishape = ctx.axes(x), ctx.axes(idx), ctx.shape(x), ctx.shape(idx)
    if xa is None or ia is None or len(ia) != len(xa) or (src is not None and ctx.shape(src) != ishape):
        return None  # a src larger than idx (only its prefix is read): not worth the cases
    sa = ctx.axes(src)
    d = dim(ctx.arg(1), len(xa))
    lab = ctx.label(idx)
    cons = [Unify(ctx.out[d], xa[d]), Meet(ia[d], "identity", f"{ctx.where}: slots of the written entries")]
    if sa is not None:
        cons.append(Unify(sa[d], ia[d]))
    if lab is not None and lab[1] == xs[d]:
        cons += [Unify(xa[d], lab[0]), Meet(xa[d], "perm", f"{ctx.where}: written at labelled entries")]
    else:
        cons.append(Meet(xa[d], "identity", f"{ctx.where}: entries picked by index values"))
        if lab is not None:
            cons.append(Meet(lab[0], "identity", f"{ctx.where}: labels index an axis of another size"))
    for k, o in enumerate(ctx.out):
        if k == d:
            continue
        cons.append(Unify(o, xa[k]))
        if ishape[k] == xs[k]:
            cons.append(Unify(o, ia[k]))
            if sa is not None:
                cons.append(Unify(o, sa[k]))
        else:
            why = f"{ctx.where}: a prefix of this axis is written"
            cons += [Meet(o, "identity", why), Meet(ia[k], "identity", why)]
            if sa is not None:
                cons.append(Meet(sa[k], "identity", why))
        cons.append(NoFiber(o, xa[d]))
    return cons


@register(aten.stack)
def stack(ctx):
    tensors = ctx.arg(0)
    d = dim(ctx.arg(1, "dim", 0), len(ctx.out))
    others = [o for k, o in enumerate(ctx.out) if k != d]
    cons = [Meet(ctx.out[d], "identity", f"{ctx.where}: stacked axis indexes its inputs")]
    for t in tensors:
        cons += [Unify(o, a) for o, a in zip(others, ctx.axes(t))]
    return cons


@register([aten.select.int, aten.select_copy.int])
def select(ctx):
    x = ctx.arg(0)
    xa = ctx.axes(x)
    d = dim(ctx.arg(1), len(xa))
    rest = [a for k, a in enumerate(xa) if k != d]
    return [Meet(xa[d], "identity", f"{ctx.where}: selects one entry")] + [
        Unify(o, a) for o, a in zip(ctx.out, rest)]


@register([aten.unbind.int, aten.unbind_copy.int])
def unbind(ctx):
    x = ctx.arg(0)
    xa = ctx.axes(x)
    d = dim(ctx.arg(1, "dim", 0), len(xa))
    rest = [a for k, a in enumerate(xa) if k != d]
    cons = [Meet(xa[d], "identity", f"{ctx.where}: unbinds entries")]
    for o in ctx.out:
        cons += [Unify(p, a) for p, a in zip(o, rest)]
    return cons


@register(aten.index_select)
def index_select(ctx):
    x, idx = ctx.arg(0), ctx.arg(2)
    xa = ctx.axes(x)
    d = dim(ctx.arg(1), len(xa))
    cons = _others(xa, ctx.out, d) + [Meet(xa[d], "identity", f"{ctx.where}: picks entries")]
    return cons + [Unify(ctx.out[d], ctx.axes(idx)[0])]


@register(aten.gather)
def gather(ctx):
    # out[.., j, ..] = x[.., idx[.., j, ..], ..] along ``dim``: x's entries there are picked by
    # values (fixed); out and idx share every axis; off ``dim`` out is x's coordinate where the
    # sizes agree (gather allows a smaller idx there: such an axis is a prefix, fixed).
    x, idx = ctx.arg(0), ctx.arg(2)
    xa, ia = ctx.axes(x), ctx.axes(idx)
    if ia is None:
        return None
    d = dim(ctx.arg(1), len(xa))
    xs, ishape = ctx.shape(x), ctx.shape(idx)
    lab = ctx.label(idx)
    if lab is not None and lab[1] == xs[d]:
        # ``scores.gather(1, top_k_index)`` (DeepSeek's routing weights): entries picked by
        # labels of their own axis' class; relabelling and permuting the axis alike leave
        # the result unchanged
        cons = [Unify(xa[d], lab[0]), Meet(xa[d], "perm", f"{ctx.where}: gathered by labels")]
    else:
        cons = [Meet(xa[d], "identity", f"{ctx.where}: entries picked by index values")]
        if lab is not None:
            cons.append(Meet(lab[0], "identity", f"{ctx.where}: labels index an axis of another size"))
    for k, o in enumerate(ctx.out):
        cons.append(Unify(o, ia[k]))
        if k == d:
            continue
        if xs[k] == ishape[k]:
            cons.append(Unify(o, xa[k]))
        else:
            cons += [Meet(xa[k], "identity", f"{ctx.where}: a prefix of this axis is gathered"),
                     Meet(o, "identity", f"{ctx.where}: a prefix of this axis is gathered")]
    return cons


@register(aten.index.Tensor)
def index(ctx):
    x, indices = ctx.arg(0), ctx.arg(1)
    xa = ctx.axes(x)
    picked = [k for k, i in enumerate(indices) if i is not None]
    if len(picked) > 1:
        return _multi_index(ctx, xa, indices, picked)
    if len(picked) != 1:
        return None
    k = picked[0]
    idx = indices[k]
    ia = ctx.axes(idx)
    if ia is None:
        return None
    if _is_mask(idx):  # x[mask]: the masked axes become one axis of the selected entries
        why = f"{ctx.where}: entries selected by a boolean mask"
        cons = [Unify(ctx.out[p], xa[p]) for p in range(k)]
        cons += [Meet(a, "identity", why) for a in [*xa[k:k + len(ia)], *ia, ctx.out[k]]]
        return cons + [Unify(ctx.out[k + 1 + p], a) for p, a in enumerate(xa[k + len(ia):])]
    lab = ctx.label(idx)
    if lab is not None and lab[1] == ctx.shape(x)[k]:
        # ``w[labels]``: relabelling the class and permuting the indexed axis alike leaves the
        # result unchanged (:mod:`symgraph.passes.labels`)
        cons = [Unify(xa[k], lab[0]), Meet(xa[k], "perm", f"{ctx.where}: indexed by labels")]
    elif (seg := constant_range(ctx.constant(idx), ctx.shape(x)[k])) is not None and len(ia) == 1:
        # ``x[..., [a, a+1, ..., b-1]]`` with literal indices (Falcon's multi-query split
        # ``qkv[..., [-2], :]`` before transformers 5.25): a slice, the axis a sum of segments
        a, b = seg
        n = ctx.shape(x)[k]
        parts = ([ctx.new_axis(a)] if a > 0 else []) + [ctx.out[k]] + ([ctx.new_axis(n - b)] if b < n else [])
        cons = [Structure(xa[k], "sum", tuple(parts))]
        return cons + [Unify(ctx.out[p], xa[p]) for p in range(len(xa)) if p != k]
    else:
        cons = [Meet(xa[k], "identity", f"{ctx.where}: indexed by a tensor")]
        if lab is not None:
            cons.append(Meet(lab[0], "identity", f"{ctx.where}: labels index an axis of another size"))
    cons += [Unify(ctx.out[p], xa[p]) for p in range(k)]
    cons += [Unify(ctx.out[k + p], a) for p, a in enumerate(ia)]
    tail = len(ia) + k
    cons += [Unify(ctx.out[tail + p], a) for p, a in enumerate(xa[k + 1:])]
    return cons


def _is_mask(node) -> bool:
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(v, torch.Tensor) and v.dtype == torch.bool


def constant_range(values, n):
    """``(a, b)`` when ``values`` is a literal 1-D index tensor holding ``a, a+1, ..., b-1``
    (negative indices counted from ``n``), else None."""
    if values is None or values.dim() != 1 or values.numel() == 0 or values.is_floating_point():
        return None
    v = [int(i) + n if int(i) < 0 else int(i) for i in values.tolist()]
    if v != list(range(v[0], v[0] + len(v))) or not 0 <= v[0] < v[-1] + 1 <= n:
        return None
    return v[0], v[-1] + 1


def _multi_index(ctx, xa, indices, picked):
    """``x[i, j]`` with several index tensors (pooling by index: ``h[arange(B), last]``): the
    indexed axes are fixed, the index tensors' broadcast axes come first when the indexed axes
    are not adjacent and in their place otherwise, and every other axis passes through."""
    if any(ctx.axes(indices[k]) is None for k in picked):
        return None
    nb = len(ctx.out) - (len(xa) - len(picked))  # broadcast dims of the index tensors
    adjacent = picked == list(range(picked[0], picked[-1] + 1))
    rest = [p for p in range(len(xa)) if p not in picked]
    if adjacent:
        before = [p for p in rest if p < picked[0]]
        after = [p for p in rest if p > picked[-1]]
        order = before + [None] * nb + after
    else:
        order = [None] * nb + rest
    cons = [Meet(xa[k], "identity", f"{ctx.where}: indexed by a tensor") for k in picked]
    for o, p in zip(ctx.out, order):
        cons.append(Meet(o, "identity", f"{ctx.where}: index positions") if p is None
                    else Unify(o, xa[p]))
    # entries along the indexed axes are picked per position: the rest may not vary along them
    cons += [NoFiber(xa[p], xa[k]) for p in rest for k in picked]
    return cons


@register(aten.constant_pad_nd)
def constant_pad(ctx):
    """Padding with a constant along some axes (window attention, convolutions): the padded
    axes are fixed; the others pass through (only permutations keep a nonzero pad value)."""
    x = ctx.arg(0)
    xa, pad = ctx.axes(x), list(ctx.arg(1))
    value = ctx.arg(2, "value", 0) or 0
    n = len(xa)
    padded = {n - 1 - i // 2 for i in range(len(pad)) if pad[i] != 0}
    cons = []
    for k in range(n):
        if k in padded:
            cons.append(Meet(xa[k], "identity", f"{ctx.where}: padded along this axis"))
            cons.append(Meet(ctx.out[k], "identity", f"{ctx.where}: padded along this axis"))
        else:
            cons.append(Unify(ctx.out[k], xa[k]))
            if value != 0 and ctx.shape(x)[k] > 1:
                cons.append(Meet(xa[k], "perm", f"{ctx.where}: padded with {value}"))
    cons += [NoFiber(xa[k], xa[d]) for k in range(n) if k not in padded for d in padded]
    return cons


@register([aten.cumsum, aten.cumprod, aten.flip, aten.roll])
def along_axis_order(ctx):
    # These depend on the order of entries along the axis: fix it, pass the rest through.
    x = ctx.arg(0)
    xa = ctx.axes(x)
    dims = ctx.arg(1)
    if ctx.node.target.overloadpacket == aten.roll:
        dims = ctx.arg(2, "dims", [])
        if not dims:
            return None
    dims = [dims] if isinstance(dims, int) else list(dims)
    dims = {dim(d, len(xa)) for d in dims}
    cons = [Unify(o, a) for o, a in zip(ctx.out, xa)]
    cons += [Meet(xa[d], "identity", f"{ctx.where}: order-dependent along this axis")
             for d in dims]
    # entries along ``d`` are mixed (cumsum) or moved (flip, roll): the other axes' elements
    # may not vary along it, and a running product is nonlinear in them.
    others = [k for k in range(len(xa)) if k not in dims]
    cons += [NoFiber(xa[k], xa[d]) for k in others for d in dims]
    if ctx.node.target.overloadpacket == aten.cumprod:
        cons += [Meet(xa[k], "perm", f"{ctx.where}: running product is elementwise nonlinear")
                 for k in others if ctx.shape(x)[k] > 1]
    return cons


@register(aten.masked_scatter)
def masked_scatter(ctx):
    # out = x with the entries ``mask`` selects taken, in order, from ``src`` (a vision-language
    # model writes its image features into the image tokens' embeddings). Where the mask is the
    # same along the last axis and ``src``'s rows are that wide, each selected row of x is one
    # row of src, channel for channel: the last axes of x, src and out are one class; every
    # other axis names positions picked by data and is fixed.
    from ..uniform import uniform_axes
    x, mask, src = ctx.arg(0), ctx.arg(1), ctx.arg(2)
    xa, ma, sa, out = ctx.axes(x), ctx.axes(mask), ctx.axes(src), ctx.out
    if xa is None or ma is None or sa is None:
        return None
    why = f"{ctx.where}: entries written by a mask"
    ms, xs = ctx.shape(mask), ctx.shape(x)
    rows = (ms[-1] == 1 or len(ma) - 1 in uniform_axes(mask, {})) and ctx.shape(src)[-1] == xs[-1]
    keep = [xa[-1], sa[-1], out[-1]] if rows else []
    cons = [Unify(o, a) for o, a in zip(out, xa)]
    if rows:
        cons.append(Unify(sa[-1], xa[-1]))
    return cons + [Meet(a, "identity", why) for a in [*xa, *ma, *sa, *out] if a not in keep]


@register([aten.unfold])
def sliding_windows(ctx):
    # x.unfold(d, size, step): axis d becomes the windows' index and a new last axis the position
    # in each window, both read along d in order (fixed, as flip's); the other axes pass through
    # and their elements may not vary along d (windows overlap).
    x = ctx.arg(0)
    xa = ctx.axes(x)
    d = dim(ctx.arg(1), len(xa))
    out = ctx.out
    cons = [Unify(out[k], xa[k]) for k in range(len(xa)) if k != d]
    cons += [Meet(a, "identity", f"{ctx.where}: sliding windows along this axis")
             for a in (xa[d], out[d], out[-1])]
    return cons + [NoFiber(xa[k], xa[d]) for k in range(len(xa)) if k != d]


@register([aten.index_put.default, aten.index_put_.default])
def index_put(ctx):
    """``x[idx] = v`` (Wav2Vec2's ``hidden[mask_time_indices] = masked_spec_embed``): the
    output is ``x``; the indexed axes are fixed (which entries are written depends on their
    order); ``v`` broadcasts against ``x[idx]`` from the right, so each of its axes that lies
    on an axis of ``x`` transforms with it, and an axis of ``x`` that ``v`` only broadcasts
    along (a size 1, or no axis) is fixed."""
    x, indices, v = ctx.arg(0), ctx.arg(1), ctx.arg(2)
    xa, va = ctx.axes(x), ctx.axes(v)
    picked = [k for k, i in enumerate(indices) if i is not None]
    if not picked or picked != list(range(picked[0], picked[-1] + 1)) or va is None:
        return None
    why = f"{ctx.where}: entries written at indexed places"
    k, span = picked[0], sum(len(ctx.shape(indices[p])) if _is_mask(indices[p]) else 1 for p in picked)
    ia = [a for p in picked for a in ctx.axes(indices[p])]
    n_sel = 1 if _is_mask(indices[k]) else max(len(ctx.shape(indices[p])) for p in picked)
    cons = [Unify(o, a) for o, a in zip(ctx.out, xa)] + [Meet(a, "identity", why) for a in [*xa[k:k + span], *ia]]
    sel = [*xa[:k], *[None] * n_sel, *xa[k + span:]]
    xs, vs = ctx.shape(x), ctx.shape(v)
    sizes = [*xs[:k], *[None] * n_sel, *xs[k + span:]]
    for j in range(1, len(sel) + 1):
        a, vax = sel[-j], va[-j] if j <= len(va) else None
        if a is not None and vax is not None and vs[-j] == sizes[-j]:
            cons.append(Unify(vax, a))
        else:
            cons += [Meet(b, "identity", why) for b in (a, vax) if b is not None]
    return cons + [Meet(b, "identity", why) for b in va[:max(0, len(va) - len(sel))]]
