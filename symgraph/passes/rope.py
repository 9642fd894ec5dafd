"""Pattern pass: rotary position embeddings, recognised from what the graph computes.

RoPE is ``y = x ⊙ cos + R(x) ⊙ sin`` where ``cos``/``sin`` are constants and ``R`` is a
90° rotation of coordinate pairs built from slices, negation and concatenation/stacking along
the last axis: ``rotate_half`` pairs ``(i, i + d/2)``, the interleaved (GPT-J) form pairs
``(2i, 2i + 1)``. The pass evaluates ``R`` symbolically on signed coordinate indices, checks
``R² = -I``, and claims the pattern's nodes. Maps commuting with every position's rotation,
among ours, are independent 2×2 rotations of each pair: the class meets ``rope``.
No module names are consulted; partial rotary (a slice of the head dim) falls out because the
pattern's ``x`` may itself be a slice.
"""
from __future__ import annotations

import numpy as np
import torch

from .registry import Rope, Unify

aten = torch.ops.aten
_BIG = 2 ** 62


def _packet(node):
    t = node.target
    return t.overloadpacket if isinstance(t, torch._ops.OpOverload) else t


def _ndim(node):
    v = node.meta.get("val")
    return v.dim() if isinstance(v, torch.Tensor) else None


def _signed_map(node, x, nodes):
    """Signed coordinate indices (1-based) of ``node`` along x's last axis, or None."""
    if node is x:
        n = x.meta["val"].shape[-1]
        return np.arange(1, n + 1)
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    p = _packet(node)
    nd = _ndim(node)
    if p in (aten.neg,):
        v = _signed_map(node.args[0], x, nodes)
        out = None if v is None else -v
    elif p in (aten.slice,):
        src, d = node.args[0], node.args[1] if len(node.args) > 1 else 0
        if d not in (-1, _ndim(src) - 1):
            return None
        v = _signed_map(src, x, nodes)
        if v is None or v.ndim != 1:
            return None
        start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
        end = node.args[3] if len(node.args) > 3 and node.args[3] is not None else len(v)
        step = node.args[4] if len(node.args) > 4 else 1
        out = v[start:min(end, len(v)):step]
    elif p in (aten.cat,):
        tensors, d = node.args[0], node.args[1] if len(node.args) > 1 else 0
        if d not in (-1, nd - 1):
            return None
        vs = [_signed_map(t, x, nodes) for t in tensors]
        if any(v is None or v.ndim != 1 for v in vs):
            return None
        out = np.concatenate(vs)
    elif p in (aten.stack,):
        tensors, d = node.args[0], node.args[1] if len(node.args) > 1 else 0
        if d not in (-1, nd - 1):
            return None
        vs = [_signed_map(t, x, nodes) for t in tensors]
        if any(v is None or v.ndim != 1 for v in vs):
            return None
        out = np.stack(vs, axis=-1)
    elif p in (aten.unsqueeze,):
        src, d = node.args
        if d not in (-1, nd - 1):
            return None
        v = _signed_map(src, x, nodes)
        out = None if v is None or v.ndim != 1 else v[:, None]
    elif p in (aten.view, aten.reshape, aten.flatten, aten._unsafe_view):
        src = node.args[0]
        v = _signed_map(src, x, nodes)
        if v is None:
            return None
        in_shape = tuple(src.meta["val"].shape)
        out_shape = tuple(node.meta["val"].shape)
        if v.ndim == 2 and in_shape[:-2] == out_shape[:-1] and out_shape[-1] == v.size:
            out = v.reshape(-1)
        elif v.ndim == 1 and in_shape == out_shape:
            out = v
        else:
            return None
    elif p in (aten.clone, aten.contiguous, aten.alias):
        out = _signed_map(node.args[0], x, nodes)
    else:
        return None
    if out is not None:
        nodes.add(node)
    return out


def _rotation_pairs(v):
    """Pairs of a signed permutation that squares to minus the identity, else None."""
    n = len(v)
    if v.ndim != 1 or sorted(abs(v)) != list(range(1, n + 1)):
        return None
    perm, sign = abs(v) - 1, np.sign(v)
    pairs = set()
    for i in range(n):
        j = perm[i]
        if j == i or perm[j] != i or sign[i] * sign[j] != -1:
            return None
        pairs.add((min(i, j), max(i, j)))
    return tuple(sorted(pairs))


def _split_mul(node, origin):
    """mul(a, b) → (varying operand, constant operand) or None."""
    if not (isinstance(node, torch.fx.Node) and _packet(node) == aten.mul):
        return None
    a, b = node.args[:2]
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
        return None
    if origin(a) == "const" and origin(b) != "const":
        return b, a
    if origin(b) == "const" and origin(a) != "const":
        return a, b
    return None


def find_rope(graph, origin, axes_of, shape_of):
    """Return ``(claimed_nodes, constraints)`` for every RoPE application in ``graph``."""
    claimed, cons = set(), []
    for node in graph.nodes:
        if node.op != "call_function" or _packet(node) != aten.add:
            continue
        ops = [_split_mul(a, origin) for a in node.args[:2]]
        if any(o is None for o in ops):
            continue
        for (x, c), (r, s) in (ops, ops[::-1]):
            inner = set()
            v = _signed_map(r, x, inner)
            pairs = None if v is None else _rotation_pairs(v)
            if pairs is None:
                continue
            pattern = inner | {node, node.args[0], node.args[1]}
            internal = pattern - {node}
            if any(u not in pattern for m in internal for u in m.users):
                continue  # an intermediate value escapes: not a pure RoPE application
            xa, out = axes_of(x), axes_of(node)
            off = len(out) - len(xa)
            new = [Unify(o, a) for o, a in zip(out[off:], xa)]
            for const in (c, s):  # constants broadcast over other axes; their last axis is the angle
                ca, cs = axes_of(const), shape_of(const)
                coff = len(out) - len(ca)
                new += [Unify(out[coff + k], a) for k, a in enumerate(ca[:-1])
                        if cs[k] == shape_of(node)[coff + k]]
            new.append(Rope(xa[-1], pairs))
            claimed |= pattern
            cons += new
            break
    return claimed, cons
