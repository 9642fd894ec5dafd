"""Rotary outputs that leave ``x``'s layout (DeepSeek-V3's ``rope_interleave``): which of them
only ever meet their partners in an attention contraction, so the layout change cancels.

``cat([x[0::2]·cos - x[1::2]·sin, x[1::2]·cos + x[0::2]·sin])`` rotates ``x``'s pairs
``(2p, 2p+1)`` and writes pair ``p`` at ``(p, p + d/2)``: the output is a fixed coordinate
permutation ``π`` of a rotation in ``x``'s layout. One class cannot hold both layouts. But where
every use of the output (and of what is built from it by layout moves: casts, views and
expands of the leading axes, concatenation or ``slice_scatter`` along the permuted axis,
transposes that keep it among the last two, products with factors constant along it) ends in
``scaled_dot_product_attention``'s query or key, or in ``q @ kᵀ`` (eager attention, DeepSeek
sparse attention's indexer), and the other operand carries the same ``π`` at the same offset
of the contracted axis, the scores ``Σ q_o k_o`` sum over ``π``'s coordinates
alike: the model computes the same function as one whose rotations keep ``x``'s layout (undo
``π`` on both sides). Every rule on the way is blind to the order inside the segment, so that
model's classes, with the output in ``x``'s class and pairs ``(2p, 2p+1)``, are this model's.
:func:`cancelling` keeps the candidates for which this holds, read from the graph alone.
"""
from __future__ import annotations

import torch

from ..nodes import ndim, op_of

__all__ = ["cancelling"]

aten = torch.ops.aten

_CHECKS = {aten._assert_tensor_metadata, aten._assert_scalar, aten._assert_async}
_CASTS = {aten._to_copy, aten.to, aten.type_as, aten.clone, aten.contiguous, aten.alias,
          aten.detach}
_VIEWS = {aten.view, aten.reshape, aten._unsafe_view, aten.unsqueeze, aten.squeeze, aten.expand}
_PRODUCTS = {aten.matmul, aten.bmm}


def _shape(node):
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(int(s) for s in v.shape) if isinstance(v, torch.Tensor) else None


def _at(d, nd, axis) -> bool:
    """Whether dimension ``d`` of an ``nd``-dimensional tensor is its ``axis``-th from the end."""
    return isinstance(d, int) and nd is not None and nd >= axis and d % nd == nd - axis


def _carry(user, src, twist):
    """The twist ``(offset, π, axis)`` of ``user`` given ``src``'s (an operand of it): the
    permuted coordinates sit at ``offset`` of the ``axis``-th axis from the end (1: the last;
    2: the one before, after a transpose of the last two, as a key is for ``q @ kᵀ``);
    ``"end"`` at an attention query or key (checked later), None where it is not understood."""
    p, (off, perm, axis) = op_of(user), twist
    us, ss = _shape(user), _shape(src)
    if us is None or ss is None or len(us) < axis or len(ss) < axis:
        return None
    kept = us[-axis:] == ss[-axis:]  # the trailing axes up to the twisted one are untouched
    if p in _CASTS or p in _VIEWS:
        return twist if user.args[0] is src and kept else None
    if p in (aten.mul, aten.div):  # by a factor constant along the twisted axis (Mistral 4's scale)
        a, b = user.args[:2]
        other = b if a is src else a if p == aten.mul and b is src else src
        os_ = _shape(other) if isinstance(other, torch.fx.Node) else ()
        if other is src or os_ is None or (len(os_) >= axis and os_[-axis] != 1) or not kept:
            return None
        return twist
    if p in (aten.transpose, aten.swapaxes, aten.swapdims, aten.permute):
        if user.args[0] is not src:
            return None
        n = len(ss)
        dims = list(range(n))
        if p == aten.permute:
            dims = [d % n for d in user.args[1]]
        else:
            a, b = (x % n for x in user.args[1:3])
            dims[a], dims[b] = dims[b], dims[a]
        moved_to = n - dims.index(n - axis)
        return (off, perm, moved_to) if moved_to in (1, 2) else None
    if p == aten.cat:
        tensors, d = list(user.args[0]), user.args[1] if len(user.args) > 1 else 0
        if not _at(d, len(us), axis) or tensors.count(src) != 1:
            return None
        before = tensors[:tensors.index(src)]
        return off + sum(_shape(t)[-axis] for t in before), perm, axis
    if p == aten.copy:  # copy(dst, src): src's values in dst's shape
        return twist if len(user.args) >= 2 and user.args[1] is src and user.args[0] is not src \
            and us == ss else None
    if p == aten.slice_scatter:
        base, s = user.args[0], user.args[1]
        d = user.args[2] if len(user.args) > 2 else user.kwargs.get("dim", 0)
        start = user.args[3] if len(user.args) > 3 else user.kwargs.get("start")
        step = user.args[5] if len(user.args) > 5 else user.kwargs.get("step", 1)
        if s is not src or base is src or not _at(d, len(us), axis) or step != 1:
            return None
        start = 0 if start is None else start
        return (start + off, perm, axis) if isinstance(start, int) and start >= 0 else None
    if p == aten.scaled_dot_product_attention:
        return "end" if axis == 1 and src in user.args[:2] and list(user.args).count(src) == 1 \
            and src not in user.kwargs.values() else None
    if p in _PRODUCTS:  # q @ kᵀ: q's last axis contracts with kᵀ's second to last
        a, b = user.args[:2]
        return "end" if a is not b and len(ss) >= 2 and (src, axis) in ((a, 1), (b, 2)) else None
    return None


def _walk(seeds):
    """``{node: (offset, π, axis)}`` over everything built from ``seeds`` by layout moves, and
    whether the walk stayed understood (every use carries the twist to a node or an end)."""
    twisted, stack = dict(seeds), list(seeds)
    while stack:
        n = stack.pop()
        for u in n.users:
            if op_of(u) in _CHECKS:
                continue
            t = _carry(u, n, twisted[n])
            if t is None:
                return twisted, False
            if t == "end":
                continue
            if u in twisted:  # two twisted operands (or two paths) meet: not handled
                return twisted, False
            twisted[u] = t
            stack.append(u)
    return twisted, True


def _mismatched(twisted) -> set:
    """The attentions reached whose query and key are not twisted alike (or whose value, mask
    or output is): the query's last axis and the key's (``kᵀ``'s second to last, for a product)
    must hold the same ``π`` at the same offset."""
    bad = set()
    for n in list(twisted):
        for u in n.users:
            if op_of(u) not in _PRODUCTS | {aten.scaled_dot_product_attention}:
                continue
            q, k = u.args[0], u.args[1]
            key_axis = 1 if op_of(u) == aten.scaled_dot_product_attention else 2
            tq, tk = twisted.get(q), twisted.get(k)
            if tq is None or tk is None or tq[2] != 1 or tk[2] != key_axis or tq[:2] != tk[:2] or any(
                    a in twisted for a in list(u.args[2:]) + list(u.kwargs.values())
                    if isinstance(a, torch.fx.Node)):
                bad.add(u)
    return bad


def cancelling(candidates):
    """The candidates (``(out, π)``: ``out``'s coordinate ``π[i]`` holds ``x``'s ``i``, after a
    rotation in ``x``'s layout) whose twists all cancel in attention contractions. A candidate
    whose walk leaves the understood ops is dropped; then, together, any whose walk meets
    another's or reaches an attention whose query and key are not twisted alike, until none.
    Returns ``{out: the nodes holding its coordinates permuted}``: no class's coordinates can
    be read there (they are not in its layout)."""
    walks = {}
    for out, perm in candidates:
        twisted, ok = _walk({out: (0, tuple(perm), 1)})
        if ok:
            walks[out] = (tuple(perm), twisted)
    while walks:
        owner: dict = {}
        drop = set()
        for out, (_, twisted) in walks.items():
            for n in twisted:
                if n in owner:
                    drop |= {out, owner[n]}
                owner[n] = out
        union = {n: t for _, tw in walks.values() for n, t in tw.items()}
        for bad in _mismatched(union):
            drop |= {owner[a] for a in list(bad.args) + list(bad.kwargs.values())
                     if isinstance(a, torch.fx.Node) and a in owner}
        if not drop:
            break
        walks = {o: w for o, w in walks.items() if o not in drop}
    return {out: set(twisted) for out, (_, twisted) in walks.items()}
