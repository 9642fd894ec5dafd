"""Buffers reshaped or cropped on their way to an addition: a table of position embeddings that
SD3's patch embedding views as a grid, crops to the image and flattens again before adding it
to the tokens. Such view nodes take rules as activations do, so the buffer can move with the
class it is added to; the driver still keeps the buffer only where every reader's rule related
each of its axes (``AxisAnalysis._settle_buffers``), along the whole chain of views.

Buffers combined with one another elementwise into a per-channel scale or shift take rules too:
a frozen batch norm (DETR's backbone) computes ``w * rsqrt(var + eps)`` and ``b - mean * scale``
from its four buffers and multiplies the activation by the first, adds the second. The scale
may multiply (or divide) an activation only where it varies along one axis at most, so a
table varying along two (rotary ``cos``/``sin`` read by a product) stays constant data.

A chain qualifies only where every path from its buffers runs through view ops (each reading
the previous node as its first argument) or elementwise ops of buffer-derived tensors and
scalars, and ends in an addition or subtraction, or a product with a per-channel chain node;
any other reader (a matmul with positions, as rotary frequencies are read) leaves the whole
connected chain as constant data, fixed as before."""
from __future__ import annotations

import torch

from .nodes import packet, packets

__all__ = ["buffer_views"]

VIEW_OPS = packets("view _unsafe_view reshape slice select unsqueeze squeeze clone alias expand permute "
                   "transpose t flatten unflatten contiguous")
ADD_OPS = packets("add sub")
SCALE_OPS = packets("mul div")
ARITH_OPS = packets("add sub mul div rsqrt sqrt reciprocal neg")


def buffer_views(graph, buffer_of) -> set:
    """The view and elementwise nodes derived from floating-point buffer placeholders
    (``buffer_of``: placeholder name -> buffer name) whose connected chain ends only in
    additions, or in products with a per-channel chain node."""
    derived: dict = {}  # node -> representative of its connected chain
    for node in graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and node.name in buffer_of and isinstance(val, torch.Tensor) \
                and val.is_floating_point():  # any other buffer is fixed: its views stay constants
            derived[node] = node
        elif node.op == "call_function" and (parents := _derived_from(node, derived)):
            derived[node] = node
            for p in parents:
                _join(derived, p, node)
    bad = {_root(derived, n) for n in derived if any(u not in derived and not _ends(u, n) for u in n.users)}
    return {n for n in derived if n.op == "call_function" and _root(derived, n) not in bad}


def _derived_from(node, derived) -> list:
    """The buffer-derived nodes ``node`` reads, when it is a view of one (first argument) or an
    elementwise op of buffer-derived tensors and scalars only; else []."""
    op = packet(node)
    if op in VIEW_OPS:
        return [node.args[0]] if node.args and node.args[0] in derived else []
    if op not in ARITH_OPS or node.kwargs:
        return []
    tensors = [a for a in node.args if isinstance(a, torch.fx.Node)]
    if not tensors or any(a not in derived for a in tensors) \
            or any(not isinstance(a, (torch.fx.Node, int, float)) for a in node.args):
        return []
    return tensors


def _ends(user, node) -> bool:
    """Whether ``user``, outside the chain, may read the chain node ``node``: an addition, or a
    product (a quotient by it) where ``node`` varies along one axis at most."""
    op = packet(user)
    if op in ADD_OPS:
        return True
    val = node.meta.get("val")
    return op in SCALE_OPS and isinstance(val, torch.Tensor) and sum(d > 1 for d in val.shape) <= 1 \
        and (op is not torch.ops.aten.div or user.args[0] is not node)


def _root(derived, n):
    while derived[n] is not n:
        derived[n] = derived[derived[n]]
        n = derived[n]
    return n


def _join(derived, a, b) -> None:
    ra, rb = _root(derived, a), _root(derived, b)
    if ra is not rb:
        derived[rb] = ra
