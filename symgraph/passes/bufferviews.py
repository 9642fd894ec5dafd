"""Buffers reshaped or cropped on their way to an addition: a table of position embeddings that
SD3's patch embedding views as a grid, crops to the image and flattens again before adding it
to the tokens. Such view nodes take rules as activations do, so the buffer can move with the
class it is added to; the driver still keeps the buffer only where every reader's rule related
each of its axes (``AxisAnalysis._settle_buffers``), along the whole chain of views.

A chain qualifies only where every path from the buffer runs through view ops (each reading
the previous node as its first argument) and ends in an addition or subtraction; any other
reader (a matmul with positions, as rotary frequencies are read) leaves the chain as constant
data, fixed as before."""
from __future__ import annotations

import torch

from .nodes import packet, packets

__all__ = ["buffer_views"]

VIEW_OPS = packets("view _unsafe_view reshape slice select unsqueeze squeeze clone alias expand permute "
                   "transpose t flatten unflatten contiguous")
ADD_OPS = packets("add sub")


def buffer_views(graph, buffer_of) -> set:
    """The view nodes of every floating-point buffer placeholder (``buffer_of``: placeholder
    name -> buffer name) whose chain of views ends only in additions."""
    out = set()
    for node in graph.nodes:
        val = node.meta.get("val")
        if node.op == "placeholder" and node.name in buffer_of and isinstance(val, torch.Tensor) \
                and val.is_floating_point():  # any other buffer is fixed: its views stay constants
            out |= _chain(node)
    return out


def _chain(buf) -> set:
    chain, todo = set(), [buf]
    while todo:
        node = todo.pop()
        for user in node.users:
            if packet(user) in VIEW_OPS and user.args and user.args[0] is node:
                chain.add(user)
                todo.append(user)
            elif packet(user) not in ADD_OPS:
                return set()
    return chain
