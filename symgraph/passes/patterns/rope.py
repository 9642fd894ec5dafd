"""Pattern pass: rotary position embeddings, recognised from what the graph computes.

RoPE is ``y = x ⊙ cos + R(x) ⊙ sin`` where ``cos``/``sin`` are constants and ``R`` is a
90° rotation of coordinate pairs built from slices, negation and concatenation/stacking along
the last axis: ``rotate_half`` pairs ``(i, i + d/2)``, the interleaved (GPT-J) form pairs
``(2i, 2i + 1)``. The pass evaluates ``R`` symbolically on signed coordinate indices, checks
``R² = -I``, and claims the pattern's nodes. Maps commuting with every position's rotation,
among ours, are independent 2×2 rotations of each pair: the class meets ``rope``.
No module names are consulted; partial rotary (a slice of the head dim) falls out because the
pattern's ``x`` may itself be a slice. Casts are read through: outside float32, Hugging Face's
``q.float() * cos + rotate_half(q.float()) * sin`` casts ``q`` once per side, and the rotated
operand (a second cast of x's source) is x's value, so every dtype gives the same classes.
"""
from __future__ import annotations

import operator

import numpy as np
import torch

from ..registry import Meet, Rope, Unify
from ..nodes import op_of
from .lastaxis import MOVES, moved, unbind_part
from .rope_forms import complex_ropes, escapes, linear_ropes, split_part, value_source

__all__ = ['find_rope']


aten = torch.ops.aten
_BIG = 2 ** 62


def _signed_map(node, x, nodes):
    """Signed coordinate indices (1-based) of ``node`` along x's last axis, or None. A copy
    of ``x``'s value (another cast of its source) is ``x`` itself; it is left to its own rule
    (not added to ``nodes``), which relates its axes to the source's."""
    if node is x or (isinstance(node, torch.fx.Node) and value_source(node) is value_source(x)):
        n = x.meta["val"].shape[-1]
        return np.arange(1, n + 1)
    if not isinstance(node, torch.fx.Node) or node.op != "call_function":
        return None
    p = op_of(node)
    part = split_part(node)
    if part is not None:  # ``x1, x2 = x.chunk(2, -1)`` (ESM's rotate_half): slices of x
        v = _signed_map(part[1], x, nodes)
        out = None if v is None or v.ndim != 1 else v[part[2]:part[3]]
        if out is not None:
            nodes.add(part[0])
    elif (ub := unbind_part(node)) is not None:  # one coordinate of each pair (diffusers)
        v = _signed_map(ub[1], x, nodes)
        out = None if v is None or v.ndim != 2 else v[:, ub[2]]
        if out is not None:
            nodes.add(ub[0])
    elif p in (aten.neg,):
        v = _signed_map(node.args[0], x, nodes)
        out = None if v is None else -v
    elif p in MOVES:  # slices, concatenations, stacks, unsqueezes and reshapes of the last axis
        out = moved(node, lambda src: _signed_map(src, x, nodes))
    elif p in (aten.clone, aten.contiguous, aten.alias, aten.to, aten._to_copy, aten.type_as):
        out = _signed_map(node.args[0], x, nodes)  # copies and casts (after the rotation, ERNIE)
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
        pairs.add((int(min(i, j)), int(max(i, j))))
    return tuple(sorted(pairs))


# Elementwise ops: equal inputs at two coordinates give equal outputs there.
_ELEMENTWISE = {
    aten.cos, aten.sin, aten.exp, aten.neg, aten.mul, aten.div, aten.add, aten.sub, aten.rsub,
    aten.pow, aten.reciprocal, aten.sqrt, aten.rsqrt, aten._to_copy, aten.clone,
    aten.contiguous, aten.alias, aten.detach, aten.lift_fresh_copy, aten.to, aten.type_as,
    aten.where, aten.copy,  # a choice or copy of its operands: equal where all are equal
}
_VIEWS = {aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten,
          aten.unsqueeze, aten.squeeze}


class _ConstIds:
    """Which coordinates of a constant are equal *by construction*.

    ``ids(node, k)`` is an int array of ``node``'s trailing ``k`` dims: equal ids mean equal
    values at every index of the leading dims. Anything not understood is a fresh leaf (all
    ids distinct), so the answer errs towards "not equal".
    """

    def __init__(self):
        self.memo, self.next, self.codes, self.alias = {}, 0, {}, {}

    def _leaf(self, shape):
        n = int(np.prod(shape)) if len(shape) else 1
        out = np.arange(self.next, self.next + n).reshape(shape)
        self.next += n
        return out

    def ids(self, node, k):
        shape = tuple(int(x) for x in node.meta["val"].shape) if isinstance(node, torch.fx.Node) \
            and isinstance(node.meta.get("val"), torch.Tensor) else None
        if shape is None:
            return None
        k = min(k, len(shape))
        key = (node, k)
        if key not in self.memo:
            try:
                out = self._ids(node, k, shape)
            except Exception:  # noqa: BLE001 - anything unexpected: a fresh leaf
                out = None
            self.memo[key] = out if out is not None else self._leaf(shape[len(shape) - k:])
        return self.memo[key]

    def _combine(self, arrays, shape):
        """Ids of an elementwise function of several arrays: equal iff equal in all."""
        arrays = [np.broadcast_to(a, shape).reshape(-1) for a in arrays]
        if len(arrays) == 1:
            return arrays[0].reshape(shape)
        out = np.empty(len(arrays[0]), dtype=np.int64)
        for i, row in enumerate(zip(*arrays)):
            out[i] = self.codes.setdefault(row, -1 - len(self.codes))
        return out.reshape(shape)

    def _ids(self, node, k, shape):
        if node.op == "placeholder" and node in self.alias:  # inside a wrapped subgraph
            return self.ids(self.alias[node], k)
        if node.op != "call_function":
            return None
        if node.target is operator.getitem and _subgraph(node.args[0]) is not None:
            return self._subgraph_ids(node, k)
        p = op_of(node)
        tail = shape[len(shape) - k:]
        nd = len(shape)
        if p in _ELEMENTWISE:
            return self._elementwise_ids(node, k, tail)
        if p in _VIEWS:
            return self._view_ids(node.args[0], tail)
        if p == aten.expand:
            src = node.args[0]
            ss = tuple(int(x) for x in src.meta["val"].shape)
            kk = min(k, len(ss))
            arr = self.ids(src, kk)
            return np.broadcast_to(arr.reshape((1,) * (k - kk) + tuple(arr.shape)), tail)
        if p in (aten.cat, aten.stack):
            return self._joined_ids(node, p, k, nd, tail)
        if p == aten.repeat_interleave and isinstance(node.args[1], int):
            src, reps = node.args[0], node.args[1]
            d = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim")
            if d is None:
                return None
            d = d + nd if d < 0 else d
            arr = self.ids(src, k)
            return arr if d < nd - k else np.repeat(arr, reps, axis=d - (nd - k))
        if p == aten.slice:
            return self._sliced_ids(node, k, nd)
        if p == aten.select:
            return self._selected_ids(node, k, nd)
        if p == aten.slice_scatter:  # ``f[..., a:b:c] = g[..., a:b:c]`` (interleaved M-RoPE)
            return self._scattered_ids(node, k, nd, tail)
        if p == aten.index:  # rows reordered (Qwen2.5-VL's windows): trailing dims kept
            return self._indexed_ids(node, k, nd)
        if node.target is operator.getitem and op_of(node.args[0]) in (aten.split, aten.split_with_sizes):
            return self._split_ids(node, k, nd)
        return None

    def _subgraph_ids(self, node, k):
        """An output of a wrapped subgraph: its placeholders read as the operands given."""
        sub, operands = _subgraph(node.args[0])
        inner = [n for n in sub.graph.nodes if n.op == "placeholder"]
        self.alias.update(zip(inner, operands))
        out = next(n for n in sub.graph.nodes if n.op == "output").args[0]
        return self.ids(out[node.args[1]], k)

    def _elementwise_ids(self, node, k, tail):
        """An elementwise op: its tensor operands' ids, broadcast, combined."""
        ops = [a for a in list(node.args) + list(node.kwargs.values())
               if isinstance(a, torch.fx.Node) and isinstance(a.meta.get("val"), torch.Tensor)]
        if not ops:
            return None
        arrs = []
        for a in ops:
            ash = tuple(a.meta["val"].shape)
            arr = self.ids(a, k)
            kk = min(k, len(ash))
            arrs.append(arr.reshape((1,) * (k - kk) + tuple(arr.shape)))
        return self._combine(arrs, tail)

    def _view_ids(self, src, tail):
        """A view: the source's ids over as many trailing dims as hold ``tail``'s entries."""
        ss = tuple(int(x) for x in src.meta["val"].shape)
        n = int(np.prod(tail))
        for m in range(0, len(ss) + 1):
            if int(np.prod(ss[len(ss) - m:])) == n:
                return self.ids(src, m).reshape(tail)
            if int(np.prod(ss[len(ss) - m:])) > n:
                return None
        return None

    def _joined_ids(self, node, p, k, nd, tail):
        """A concatenation or stack: along a trailing dim the inputs' ids side by side, along
        a leading one each trailing coordinate must agree in every input."""
        tensors = node.args[0]
        d = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
        d = d + nd if d < 0 else d
        if p == aten.cat and d >= nd - k:
            return np.concatenate([self.ids(t, k) for t in tensors], axis=d - (nd - k))
        if p == aten.stack and d >= nd - k:
            return np.stack([self.ids(t, k - 1) for t in tensors], axis=d - (nd - k))
        return self._combine([self.ids(t, k) for t in tensors], tail)

    def _sliced_ids(self, node, k, nd):
        """A slice: the source's ids, sliced where the dim is a trailing one."""
        src, d = node.args[0], node.args[1] if len(node.args) > 1 else 0
        d = d + nd if d < 0 else d
        arr = self.ids(src, k)
        if d < nd - k:
            return arr
        n = arr.shape[d - (nd - k)]
        start = node.args[2] if len(node.args) > 2 and node.args[2] is not None else 0
        end = node.args[3] if len(node.args) > 3 and node.args[3] is not None else n
        step = node.args[4] if len(node.args) > 4 else 1
        idx = [slice(None)] * k
        idx[d - (nd - k)] = slice(start, min(end, n), step)
        return arr[tuple(idx)]

    def _selected_ids(self, node, k, nd):
        """``src.select(d, i)``: the source's ids, index ``i`` taken where ``d`` is a trailing dim."""
        src, d, i = node.args[:3]
        ns = nd + 1
        d = d + ns if d < 0 else d
        if d < ns - k:
            return self.ids(src, k)
        arr = self.ids(src, k + 1)
        return np.take(arr, i, axis=d - (ns - k - 1))

    def _indexed_ids(self, node, k, nd):
        """``src[i, j, ...]`` with index tensors on leading dims only: the source's ids (its
        trailing dims come through in order); else None."""
        src, idx = node.args[:2]
        ns = len(src.meta["val"].shape)
        last = max((i for i, t in enumerate(idx) if t is not None), default=ns)
        if last >= ns - k or tuple(src.meta["val"].shape[ns - k:]) != tuple(node.meta["val"].shape[nd - k:]):
            return None
        return self.ids(src, k)

    def _scattered_ids(self, node, k, nd, tail):
        """``slice_scatter(x, y, d, start, end, step)``: x's ids with y's in that slice where
        ``d`` is a trailing dim; along a leading one, equal only where both are equal."""
        x, y = node.args[:2]
        d = node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)
        d = d + nd if d < 0 else d
        a, b = self.ids(x, k), self.ids(y, k)
        if d < nd - k:
            return self._combine([a, b], tail)
        out, ax = np.array(np.broadcast_to(a, tail)), d - (nd - k)
        n = out.shape[ax]
        start = node.args[3] if len(node.args) > 3 and node.args[3] is not None else 0
        end = node.args[4] if len(node.args) > 4 and node.args[4] is not None else n
        step = node.args[5] if len(node.args) > 5 else 1
        idx = [slice(None)] * k
        idx[ax] = slice(start, min(end, n), step)
        out[tuple(idx)] = b
        return out

    def _split_ids(self, node, k, nd):
        """A part of a ``split``: the source's ids, that part's range where the dim is a
        trailing one."""
        sp, i = node.args
        src, sizes = sp.args[0], sp.args[1]
        d = sp.args[2] if len(sp.args) > 2 else sp.kwargs.get("dim", 0)
        d = d + nd if d < 0 else d
        arr = self.ids(src, k)
        if d < nd - k:
            return arr
        n = arr.shape[d - (nd - k)]
        if isinstance(sizes, int):
            sizes = [sizes] * (-(-n // sizes))
        start = sum(sizes[:i])
        idx = [slice(None)] * k
        idx[d - (nd - k)] = slice(start, start + sizes[i])
        return arr[tuple(idx)]

def _subgraph(node):
    """``(GraphModule, operands)`` of a higher-order op that runs a subgraph
    (``wrap_with_set_grad_enabled``, ``wrap_with_autocast``: HF rotary embeddings), or None."""
    if not (isinstance(node, torch.fx.Node) and node.op == "call_function"
            and isinstance(node.target, torch._ops.HigherOrderOperator)):
        return None
    for i, a in enumerate(node.args):
        if isinstance(a, torch.fx.Node) and a.op == "get_attr":
            sub = getattr(node.graph.owning_module, a.target, None)
            if isinstance(sub, torch.fx.GraphModule):
                return sub, [x for x in node.args[i + 1:]]
    return None


def _pair_symmetric(const, pairs, ids):
    """``const`` takes equal values on both coordinates of every pair, along its last axis."""
    shape = const.meta["val"].shape
    if len(shape) == 0 or int(shape[-1]) == 1:
        return True
    v = ids.ids(const, 1)
    return all(v[i] == v[j] for i, j in pairs)


class _Tables:
    """Which values can be rotary tables: constants, or values computed from the caller's
    inputs alone, with no parameter on the way (Flux computes its angles from the position ids
    it is given). No map acts on either, so a rotation by them commutes with a class exactly
    when the tables are pair-symmetric, which :func:`_pair_symmetric` checks on how they are
    computed, whatever their values."""

    def __init__(self, origin):
        self.origin, self.memo = origin, {}

    def __call__(self, node) -> bool:
        todo, out = [node], True
        while todo:
            n = todo.pop()
            if n in self.memo:
                out = out and self.memo[n]
                continue
            source = self.origin(n)
            if source == "const" or n.op == "placeholder":
                self.memo[n] = source != "param"
                out = out and self.memo[n]
                continue
            if n.op != "call_function":
                self.memo[n] = False
                return False
            ins = [a for a in n.all_input_nodes if a not in self.memo]
            if ins:
                todo += [n, *ins]
                continue
            self.memo[n] = all(self.memo[a] for a in n.all_input_nodes)
            out = out and self.memo[n]
        return out


def _split_mul(node, table):
    """mul(a, b) → (varying operand, table operand) or None (``table``: a :class:`_Tables`)."""
    if not (isinstance(node, torch.fx.Node) and op_of(node) == aten.mul):
        return None
    a, b = node.args[:2]
    if not (isinstance(a, torch.fx.Node) and isinstance(b, torch.fx.Node)):
        return None
    ta, tb = table(a), table(b)
    if ta and not tb:
        return b, a
    if tb and not ta:
        return a, b
    return None


def find_rope(graph, origin, axes_of, shape_of):
    """Return ``(claimed_nodes, constraints, unobservable nodes)`` for every RoPE application
    in ``graph`` (unobservable: where a rotation's output holds its class's coordinates
    permuted, :mod:`.rope_twist`):
    ``x ⊙ cos + R(x) ⊙ sin`` (rotate_half, interleaved), complex multiplication
    (:func:`~.rope_forms.complex_ropes`) and concatenated per-pair linear forms
    (:func:`~.rope_forms.linear_ropes`)."""
    claimed, cons = set(), []
    ids, table = _ConstIds(), _Tables(origin)
    for node in graph.nodes:
        if node.op != "call_function" or op_of(node) != aten.add:
            continue
        ops = [_split_mul(a, table) for a in node.args[:2]]
        if any(o is None for o in ops):
            continue
        for (x, c), (r, s) in (ops, ops[::-1]):
            inner = set()
            v = _signed_map(r, x, inner)
            pairs = None if v is None else _rotation_pairs(v)
            if pairs is None:
                continue
            # rotations of a pair commute with [[c_i, -s_i], [s_j, c_j]] only when c_i = c_j
            # and s_i = s_j: the constants must be built pair-symmetric (cat((f, f)),
            # repeat_interleave), which we check on how they are computed, not on values.
            if not (_pair_symmetric(c, pairs, ids) and _pair_symmetric(s, pairs, ids)):
                continue
            pattern = inner | {node, node.args[0], node.args[1]}
            if escapes(pattern, node):
                continue  # an intermediate value escapes: not a pure RoPE application
            xa, out = axes_of(x), axes_of(node)
            xs, os_ = shape_of(x), shape_of(node)
            off = len(out) - len(xa)
            new = []
            for k, o in enumerate(out):  # x broadcast against the tables: those axes are fixed
                if k >= off and xs[k - off] == os_[k]:
                    new.append(Unify(o, xa[k - off]))
                else:
                    new.append(Meet(o, "identity", f"{node.name}: rotary tables broadcast x"))
            for const in (c, s):  # constants broadcast over other axes; their last axis is the angle
                ca, cs = axes_of(const), shape_of(const)
                coff = len(out) - len(ca)
                new += [Unify(out[coff + k], a) for k, a in enumerate(ca[:-1])
                        if cs[k] == shape_of(node)[coff + k]]
            new.append(Rope(xa[-1], pairs))
            claimed |= pattern
            cons += new
            break
    unobservable: set = set()
    # the other forms read a table as "const": values computed from the inputs alone count too
    tables = lambda n: "const" if table(n) else origin(n)  # noqa: E731
    for found in (complex_ropes(graph, tables, axes_of, shape_of, claimed),
                  linear_ropes(graph, tables, axes_of, shape_of, claimed, ids, unobservable)):
        for pattern, new in found:
            claimed |= pattern
            cons += new
    return claimed, cons, unobservable
