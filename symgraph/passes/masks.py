"""Which activations may hold an additive mask's fill value, read from the graph.

Eager attention (Hugging Face's ``eager_attention_forward``, GPT-OSS's attention with sinks)
adds a mask built as ``where(allowed, 0, finfo.min)`` or ``masked_fill(..., -inf)`` to the
scores, then takes a softmax. Between the two, the scores' masked entries hold about ``-3.4e38``
(the same in every head): as activation samples they swamp every cross-moment, and the
correlation of two heads there says nothing about them. Such tensors are no place to observe a
class (:func:`~.axes.observation_points` skips them); the softmax (or an ``exp``) maps the fill
to zero and ends it.

A fill is a literal scalar of magnitude at least ``1e30`` (a quarter of the largest finite value
in a 16-bit output), infinite or NaN in an op's arguments; clamps are bounds, not fills. Every value computed from one holds it, up to a saturating op.
"""
from __future__ import annotations

import math

import torch

from .nodes import flat_nodes, op_of, packets

__all__ = ["filled_nodes"]

aten = torch.ops.aten

_HUGE = 1e30
_BOUNDS = {aten.clamp, aten.clamp_min, aten.clamp_max, aten.clip, aten.hardtanh}  # a bound, not a fill
# a fill goes in, none comes out: the masked entries become exact zeros (or ones)
# (attention takes its softmax inside: SDPA's mask ends there)
_SATURATE = {aten.softmax, aten._softmax, aten._safe_softmax, aten.exp, aten.sigmoid, aten.tanh} | packets(
    "scaled_dot_product_attention _scaled_dot_product_attention_math _scaled_dot_product_flash_attention "
    "_scaled_dot_product_flash_attention_for_cpu _scaled_dot_product_efficient_attention "
    "_scaled_dot_product_cudnn_attention _flash_attention_forward _efficient_attention_forward")


def _scalars(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from _scalars(a)
        elif isinstance(a, float):
            yield a


def _fills(node) -> bool:
    if node.op != "call_function" or op_of(node) in _BOUNDS:
        return False
    v = node.meta.get("val")
    huge = _HUGE  # a 16-bit mask fills with its own dtype's minimum (-65504 in float16)
    if isinstance(v, torch.Tensor) and v.is_floating_point():
        huge = min(huge, torch.finfo(v.dtype).max / 4)
    return any(math.isnan(x) or abs(x) >= huge
               for x in _scalars(list(node.args) + list(node.kwargs.values())))


def _floating(v) -> bool:
    if isinstance(v, (list, tuple)):
        return any(_floating(x) for x in v)
    return isinstance(v, torch.Tensor) and v.is_floating_point()


def filled_nodes(graph) -> set:
    """The nodes of ``graph`` whose value may hold a mask fill (a literal of magnitude
    ``≥ 1e30`` or infinite, and any floating-point value computed from one before a softmax
    or ``exp``; integers, ``topk``'s indices among them, hold none)."""
    out: set = set()
    for node in graph.nodes:
        if node.op != "call_function" or not _floating(node.meta.get("val")):
            continue
        if _fills(node) or (op_of(node) not in _SATURATE
                            and any(a in out for a in flat_nodes(list(node.args) + list(node.kwargs.values())))):
            out.add(node)
    return out
