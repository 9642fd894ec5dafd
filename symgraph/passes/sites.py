"""Where a graph computes attention: ``scaled_dot_product_attention`` ops, and attention written
out (Hugging Face's ``eager_attention_forward``): ``matmul(softmax(f(matmul(q, kᵀ))), v)``.

In the written-out form, ``f`` is any chain of elementwise ops on the scores: the scale, an
additive mask, and Gemma 2's softcapping ``tanh(s / c) · c``. Elementwise ops on the scores act
on no head-size axis, so they keep every per-head map of the query-key contraction and of the
value-output side (the per-op rules already give the groups: tanh meets the batch, head and
position axes with signed permutations, which the softmax narrows to permutations anyway); what
this module adds is *where* the two head-size classes are, for the report's
``attention_groups`` (and so for ``symgraph rotate``'s value-output rotations and circuit space).
"""
from __future__ import annotations

import torch

from .nodes import ndim, op_of, packets

__all__ = ["attention_sites"]

aten = torch.ops.aten

_SDPA = aten.scaled_dot_product_attention
_MATMUL = {aten.matmul, aten.bmm}
_SOFTMAX = packets("softmax _softmax _safe_softmax")
# between the softmax and the value product: casts and an inactive dropout pass the weights on
_PASS = packets("_to_copy clone contiguous alias detach dropout") | {aten.to}
# between the scores and the softmax: elementwise ops (scale, mask, softcap, casts)
_SCORES = packets("mul div add sub tanh where masked_fill _to_copy clone contiguous alias detach") | {aten.to}
_DEPTH = 16


def _last(dim, nd) -> bool:
    return dim in (-1, nd - 1)


def _probs_of(x):
    """The softmax over the last axis that ``x`` passes on unchanged, else None."""
    while op_of(x) in _PASS:
        x = x.args[0]
    if op_of(x) in _SOFTMAX and len(x.args) > 1 and _last(x.args[1], ndim(x) or 0):
        return x
    return None


def _scores_of(x):
    """The one ``matmul``/``bmm`` the scores ``x`` come from through elementwise ops, else None."""
    found, seen, todo = set(), set(), [(x, 0)]
    while todo:
        n, depth = todo.pop()
        if not isinstance(n, torch.fx.Node) or n in seen or depth > _DEPTH:
            continue
        seen.add(n)
        if op_of(n) in _MATMUL:
            found.add(n)
        elif op_of(n) in _SCORES:
            todo += [(a, depth + 1) for a in n.args if isinstance(a, torch.fx.Node)]
    return next(iter(found)) if len(found) == 1 else None


def _eager(node):
    """``(query, value)`` of a written-out attention whose value product is ``node``, else None."""
    if op_of(node) not in _MATMUL or len(node.args) != 2:
        return None
    probs, v = node.args
    probs = _probs_of(probs) if isinstance(probs, torch.fx.Node) else None
    scores = _scores_of(probs.args[0]) if probs is not None else None
    if scores is None or len(scores.args) != 2:
        return None
    q, kt = scores.args
    if not all(isinstance(t, torch.fx.Node) and (ndim(t) or 0) >= 3 for t in (q, kt, v)):
        return None  # per-head attention has batch (and head) axes
    return q, v


def attention_sites(an) -> list:
    """``[(node name, query head-size axis, value head-size axis)]`` per attention: every
    ``scaled_dot_product_attention`` op and every written-out attention (named by its value
    product), in graph order (the key's axis is unified with the query's)."""
    out = []
    for node in an.graph.nodes:
        if node.op != "call_function":
            continue
        if op_of(node) is _SDPA:
            q, _, v = node.args[:3]
        else:
            qv = _eager(node)
            if qv is None:
                continue
            q, v = qv
        out.append((node.name, an.node_axes[q][-1], an.node_axes[v][-1]))
    return out
