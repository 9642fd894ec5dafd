"""Axes along which a constant of the program does not vary (an additive attention bias of
zeros plus a causal mask shared by every head: T5's cross-attention). A constant fixes the
axes it varies along; along the others it is ``c·𝟙`` per slice, which every permutation keeps
(zeros: every linear map), so the axis need not be fixed, only narrowed to permutations."""
from __future__ import annotations

import operator

import torch

from .nodes import packet

__all__ = ["is_zeros", "uniform_axes", "value_axes"]

aten = torch.ops.aten

_ELEMENTWISE = {aten.add, aten.sub, aten.mul, aten.div, aten.where, aten.masked_fill, aten.maximum,
                aten.minimum, aten.eq, aten.ne, aten.lt, aten.le, aten.gt, aten.ge, aten.logical_and,
                aten.logical_or, aten.logical_not, aten.bitwise_and, aten.bitwise_or, aten.bitwise_not,
                aten.neg, aten.clone, aten.alias, aten._to_copy, aten.contiguous, aten.detach,
                aten.lift_fresh_copy, aten.rsub, aten.clamp, aten.abs, aten.exp,
                aten.to}  # ``to`` as traced (a dtype or device only: OmniASR's audio mask)
_FILLS = {aten.zeros, aten.zeros_like, aten.new_zeros, aten.full, aten.full_like, aten.new_full, aten.ones,
          aten.ones_like, aten.new_ones, aten.scalar_tensor}


def _shape(node):
    v = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def uniform_axes(node, memo: dict) -> frozenset:
    """Indices of ``node``'s output axes along which its value does not vary (size-1 axes
    included), for a constant built by fills, elementwise ops, ``expand``, ``unsqueeze`` and
    slices along other axes; the empty set where that is not known."""
    if node in memo:
        return memo[node]
    memo[node] = frozenset()  # a cycle (never expected) knows nothing
    shape, p = _shape(node), packet(node.target) if node.op == "call_function" else None
    out: set = set() if shape is None else {j for j, s in enumerate(shape) if s == 1}
    if shape is None or p is None:
        pass
    elif p in _FILLS:
        out = set(range(len(shape)))
    elif p in _ELEMENTWISE:
        ops = [a for a in node.args if isinstance(a, torch.fx.Node)]
        if all(_shape(a) is not None for a in ops):
            out |= {j for j in range(len(shape)) if all(_along(a, j, len(shape), memo) for a in ops)}
    elif p in (aten.expand, aten.expand_as) and isinstance(node.args[0], torch.fx.Node):
        src = _shape(node.args[0])
        if src is not None:
            out |= {j for j in range(len(shape)) if _along(node.args[0], j, len(shape), memo)}
    elif p is aten.unsqueeze and isinstance(node.args[0], torch.fx.Node):
        d = node.args[1] % len(shape)
        inner = uniform_axes(node.args[0], memo)
        out |= {j for j in range(len(shape)) if j != d and (j if j < d else j - 1) in inner}
    elif p is aten.slice and isinstance(node.args[0], torch.fx.Node):
        out |= set(uniform_axes(node.args[0], memo))
    memo[node] = frozenset(out)
    return memo[node]


def value_axes(t) -> frozenset:
    """Indices of the axes along which the tensor ``t`` (a stored constant: a buffer a
    checkpoint does not hold, Falcon-H1's µP multipliers) does not vary; the empty set for
    anything else, or values unknown (on ``meta``)."""
    if not isinstance(t, torch.Tensor) or t.is_meta:
        return frozenset()
    return frozenset(j for j in range(t.dim()) if bool((t == t.narrow(j, 0, 1)).all()))


def _along(operand, j, ndim, memo) -> bool:
    """Whether ``operand``, broadcast (right-aligned) to ``ndim`` axes, does not vary along ``j``."""
    s = _shape(operand)
    k = j - (ndim - len(s))
    return k < 0 or s[k] == 1 or k in uniform_axes(operand, memo)


_ZEROS = {aten.zeros, aten.zeros_like, aten.new_zeros}
_FULL = {aten.full, aten.full_like, aten.new_full}


#: ops whose output holds only values of their first argument (a copy of zeros is zeros; an
#: LSTM's zero state is unbound per layer, then each layer's taken by ``getitem``)
_COPIES = {aten.clone, aten.alias, aten._to_copy, aten.contiguous, aten.detach, aten.expand,
           aten.view, aten.reshape, aten._unsafe_view, aten.permute, aten.transpose, aten.t,
           aten.unsqueeze, aten.squeeze, aten.lift_fresh_copy, aten.unbind, aten.select,
           aten.slice, aten.split, aten.split_with_sizes, aten.chunk, aten.narrow, operator.getitem}


def is_zeros(node) -> bool:
    """A tensor of zeros (a scan's initial state), or a copy, view or cast of one (xLSTM
    clones its zero state): every linear map keeps it, so it fixes nothing it is concatenated
    or added to."""
    for _ in range(16):
        p = packet(node.target) if callable(node.target) else None
        if p in _COPIES and node.args and isinstance(node.args[0], torch.fx.Node):
            node = node.args[0]
            continue
        return p in _ZEROS or (p in _FULL and len(node.args) > 1 and node.args[-1] == 0
                               and not isinstance(node.args[-1], bool))
    return False
