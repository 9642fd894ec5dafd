"""Where the coordinates of a value's last axis go through the ops that only move them: a slice
of that axis, a concatenation or stack along it, an unsqueeze after it, a reshape that merges
it with (or keeps it apart from) the axis before it or splits it into pairs, and one part of an
``unbind`` of those pairs (diffusers' interleaved rotary: ``x.reshape(..., -1, 2).unbind(-1)``). The RoPE passes follow a record per
coordinate through these ops alike: signed indices (:mod:`.rope`), linear forms
(:mod:`.rope_forms`).
"""
from __future__ import annotations

import operator

import numpy as np
import torch

from ..nodes import ndim, op_of

__all__ = ["MOVES", "moved", "unbind_part"]

aten = torch.ops.aten

_RESHAPES = (aten.view, aten.reshape, aten.flatten, aten._unsafe_view)
#: The ops :func:`moved` reads.
MOVES = (aten.slice, aten.cat, aten.stack, aten.unsqueeze, *_RESHAPES)


def moved(node, read):
    """The record of ``node`` (an op of :data:`MOVES`) along its last axis, from its sources'
    (``read(source)``: a numpy array over the source's last axis, or its last two after a
    stack, or None); None where the op moves another axis or a source's record is None."""
    p = op_of(node)
    if p == aten.slice:
        return _sliced(node, read)
    if p in (aten.cat, aten.stack):
        tensors, d = node.args[0], node.args[1] if len(node.args) > 1 else 0
        if d not in (-1, ndim(node) - 1):
            return None
        vs = [read(t) for t in tensors]
        if any(v is None or v.ndim != 1 for v in vs):
            return None
        return np.concatenate(vs) if p == aten.cat else np.stack(vs, axis=-1)
    if p == aten.unsqueeze:
        src, d = node.args
        v = read(src) if d in (-1, ndim(node) - 1) else None
        return None if v is None or v.ndim != 1 else v[:, None]
    if p in _RESHAPES:
        return _reshaped(node, read)
    return None


def _sliced(node, read):
    """``x[..., start:end:step]``: those coordinates of the source's record."""
    src, d = node.args[0], node.args[1] if len(node.args) > 1 else 0
    if d not in (-1, ndim(src) - 1):
        return None
    v = read(src)
    if v is None or v.ndim != 1:
        return None
    start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
    end = node.args[3] if len(node.args) > 3 and node.args[3] is not None else len(v)
    step = node.args[4] if len(node.args) > 4 else 1
    return v[start:min(end, len(v)):step]


def _reshaped(node, read):
    """A reshape that flattens a stack's last two axes into one, or leaves the shape as it is."""
    src = node.args[0]
    v = read(src)
    if v is None:
        return None
    in_shape, out_shape = tuple(src.meta["val"].shape), tuple(node.meta["val"].shape)
    if v.ndim == 2 and in_shape[:-2] == out_shape[:-1] and out_shape[-1] == v.size:
        return v.reshape(-1)
    if v.ndim == 1 and len(out_shape) >= 2 and in_shape[:-1] == out_shape[:-2] \
            and out_shape[-2] * out_shape[-1] == v.size:  # the last axis split: ``(..., d/k, k)``
        return v.reshape(out_shape[-2:])
    return v if v.ndim == 1 and in_shape == out_shape else None


def unbind_part(node):
    """``(unbind, source, i)`` where ``node`` is part ``i`` of an ``unbind`` of ``source``'s
    last axis (its record's second axis, after a reshape into pairs); else None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function"
            and node.target is operator.getitem and len(node.args) == 2):
        return None
    ub, i = node.args
    if not (isinstance(ub, torch.fx.Node) and op_of(ub) == aten.unbind and isinstance(i, int)):
        return None
    src = ub.args[0]
    d = ub.args[1] if len(ub.args) > 1 else ub.kwargs.get("dim", 0)
    if not isinstance(src, torch.fx.Node) or d not in (-1, ndim(src) - 1):
        return None
    return ub, src, i
