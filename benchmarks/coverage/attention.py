"""Attention sites of a traced graph for the completeness check: their heads, how many distinct
key heads feed them (1: multi-query), and whether a query/key norm leaves RoPE no class."""
from __future__ import annotations

import math

from .graph import LAYOUT_OPS, LINEAR, dim_before, is_constant, linear_weight, module_paths, node_shape, pname

__all__ = ["attention_units", "ROPE_BLOCKED", "ROPE_ABSENT"]

ROPE_BLOCKED = ("query/key norm (mean-subtracting, or with per-dimension gains) before or after "
                "the rotation: the gains do not commute with the rotations, so only a discrete "
                "subgroup of each pair's SO(2) survives and no rope class exists")
ROPE_ABSENT = ("the config has rotary parameters but the traced graph rotates nothing: no attention "
               "site multiplies its queries by a position table, and no sin, cos or complex value "
               "reaches an attention (its layers use no positional encoding)")


def attention_units(ep) -> list:
    """Every attention site, one per module (the innermost holding parameters): ``{"module",
    "heads", "qk_norm", "rotated", "kv_heads", "query", "key"}`` (the last two: nodes) for each
    ``scaled_dot_product_attention`` (heads: dim 1 of the query) and each softmax over a >= 4-d
    tensor that is no projection of one activation (heads: its dim 1)."""
    params = list(ep.graph_signature.inputs_to_parameters.values())
    out = {}
    for n in ep.graph.nodes:
        if n.op != "call_function":
            continue
        name = pname(n) or str(n.target)
        if "scaled_dot_product" in name or "flash_attention" in name:
            s = node_shape(n.args[0]) if n.args and hasattr(n.args[0], "op") else None
            query = n.args[0]
        elif name in ("softmax", "_softmax"):
            s = node_shape(n)
            s = s if s is not None and len(s) >= 4 and not _projected_scores(ep, n) else None
            query = n
        else:
            continue
        if s is None or len(s) < 4:
            continue
        module = next((p for p in module_paths(n) if p and any(q.startswith(p + ".") for q in params)), "")
        if module not in out:
            key = n.args[1]
            if query is n:  # a softmax: the query and key of the matmul that makes its scores
                mm = _scores_matmul(n)
                query, key = (mm.args[0], mm.args[1]) if mm is not None else (n, None)
            qk_norm, rotated = _normalised(ep, query)
            # a rope class rotates queries and keys alike: a norm on either blocks it
            qk_norm = qk_norm or hasattr(key, "op") and _normalised(ep, key)[0]
            # a query broadcast along the head axis (one learned query: Inkling's) is one head
            heads = 1 if query is not n and _broadcast_axis(query, 1) else int(s[1])
            out[module] = {"module": module, "heads": heads, "qk_norm": qk_norm, "rotated": rotated,
                           "kv_heads": _kv_heads(key, len(s) - 3) if hasattr(key, "op") else None,
                           "query": query, "key": key}
    return list(out.values())


def _projected_scores(ep, softmax) -> bool:
    """Whether a softmax's scores are a projection of one activation (a linear-like op of a stored
    parameter, through elementwise ops and views) and no other product: a gate or mixing weight
    (DeepSeek-V4's hyper-connections), not attention."""
    stack, seen, projected = [a for a in softmax.all_input_nodes if not is_constant(ep, a)], set(), False
    while stack and len(seen) < 64:
        n = stack.pop()
        if n in seen or not hasattr(n, "op") or n.op != "call_function":
            continue
        seen.add(n)
        name = pname(n)
        if name in LINEAR or name == "einsum":
            if name == "einsum" or linear_weight(ep, n) is None:
                return False  # query times key
            projected = True
            continue
        stack.extend(a for a in n.all_input_nodes if not is_constant(ep, a))
    return projected and not stack


def _broadcast_axis(node, dim) -> bool:
    """Whether axis ``dim`` of ``node`` is made by ``expand`` from a new or unit axis (through
    copies, casts and layout ops)."""
    for _ in range(16):
        if not hasattr(node, "op") or node.op != "call_function" or not node.args:
            return False
        name, src = pname(node), node.args[0]
        so, si = node_shape(node), node_shape(src) if hasattr(src, "op") else None
        if so is None or si is None:
            return False
        dim %= len(so)
        if name in ("expand", "expand_as"):
            k = dim - (len(so) - len(si))
            return k < 0 or si[k] == 1 and so[dim] > 1
        if name in ("clone", "contiguous", "_to_copy", "to", "alias", "detach", "type_as"):
            pass
        elif name in LAYOUT_OPS:
            dim = dim_before(node, name, dim, len(so))
            if dim is None:
                return False
        else:
            return False
        node = src
    return False


_SCORE_OPS = {"add", "sub", "mul", "div", "_to_copy", "to", "masked_fill", "where", "clone",
              "contiguous", "tanh", "alias", "cat"}  # cat: attention sinks beside the scores
_BROADCAST = {"expand", "expand_as", "unsqueeze", "reshape", "view", "_unsafe_view", "transpose",
              "permute", "clone", "contiguous", "_to_copy", "to", "alias", "detach", "type_as",
              "repeat_interleave", "repeat", "squeeze"}


def _scores_matmul(softmax):
    """The ``matmul``/``bmm`` making a softmax's scores (through masks, scales, casts), else None."""
    n = softmax.args[0] if softmax.args else None
    for _ in range(16):
        if not hasattr(n, "op") or n.op != "call_function":
            return None
        if pname(n) in ("matmul", "bmm"):
            return n
        if pname(n) not in _SCORE_OPS:
            return None
        ins = [a for a in n.all_input_nodes if node_shape(a) is not None and len(node_shape(a)) >= 3]
        if not ins:
            return None
        n = ins[0]
    return None


def _kv_heads(key, hdim):
    """The distinct key heads of an attention with head axis ``hdim`` of ``key``: its head count
    divided by every broadcast on its way from the projection (1: multi-query)."""
    shape = node_shape(key)
    if shape is None or hdim < 0 or hdim >= len(shape):
        return None
    heads, n = int(shape[hdim]), key
    for _ in range(32):
        name = pname(n) if hasattr(n, "op") and n.op == "call_function" else None
        if name not in _BROADCAST or not n.args or not hasattr(n.args[0], "op"):
            break
        src, so, si = n.args[0], node_shape(n), node_shape(n.args[0])
        if so is not None and si is not None:
            grow = math.prod(so) // max(math.prod(si), 1)  # broadcast copies (1: a relayout)
            if grow > 1 and heads % grow == 0:
                heads //= grow
        n = src
    return heads


_CENTRED = {"layer_norm", "native_layer_norm", "group_norm", "native_group_norm"}


def _gain(ep, n) -> bool:
    """Whether ``n`` multiplies (or, as a norm op, scales) by a per-dimension parameter."""
    name = pname(n)
    if name in ("rms_norm", "_fused_rms_norm", "layer_norm", "native_layer_norm"):
        w = n.args[2] if len(n.args) > 2 else n.kwargs.get("weight")
        return hasattr(w, "op") and _param_derived(ep, w)
    if name in ("mul", "mul_"):  # varying along the last (head-dimension) axis: a per-head
        return any(is_constant(ep, a) and _param_derived(ep, a)  # scale commutes with rotations
                   and (node_shape(a) or (1,))[-1] > 1 for a in n.all_input_nodes)
    return False


def _param_derived(ep, node) -> bool:
    """Whether a constant ``node`` of more than one entry is computed from a parameter (Gemma's ``1 + w``)."""
    s = node_shape(node)
    if not s or math.prod(s) <= 1:
        return False
    params = ep.graph_signature.inputs_to_parameters
    stack, seen = [node], set()
    while stack and len(seen) < 64:
        n = stack.pop()
        if n in seen or not hasattr(n, "op"):
            continue
        seen.add(n)
        if n.op == "placeholder" and n.name in params:
            return True
        stack.extend(n.all_input_nodes)
    return False


def _rotation(ep, n) -> bool:
    """Whether ``n`` multiplies by a position table (a constant not made from a parameter,
    varying along at least two axes: RoPE's cos or sin)."""
    if pname(n) not in ("mul", "mul_"):
        return False
    return any(is_constant(ep, a) and not _param_derived(ep, a)
               and sum(s > 1 for s in (node_shape(a) or ())) >= 2 for a in n.all_input_nodes)


def _normalised(ep, node) -> tuple:
    """``(blocked, rotated)`` for the query ``node``: ``rotated``, whether a RoPE rotation lies
    between its projection and it; ``blocked``, whether on every path back to the projection each
    rotation's input (or the query itself, a norm after the rotations) passes a norm the
    rotations cannot pass: a mean-subtracting norm, or a norm with per-dimension gains (a
    rotation commutes with an RMS scale alone). Then no ``rope`` class can exist; a norm on
    coordinates not rotated (another branch of a ``cat``) blocks nothing."""
    rotations, stack, seen = [], [node], set()
    while stack and len(seen) < 400:
        n = stack.pop()
        if n in seen or not hasattr(n, "op") or n.op != "call_function":
            continue
        seen.add(n)
        if _rotation(ep, n):
            rotations.append(n)
        if pname(n) in LINEAR and n is not node:
            continue
        stack.extend(a for a in n.all_input_nodes if not is_constant(ep, a))
    memo = {}

    def covered(n, gained):
        if (n, gained) in memo:
            return memo[n, gained]
        memo[n, gained] = False  # a cycle or a deep walk: not proven
        if len(memo) > 2000 or not hasattr(n, "op") or n.op != "call_function":
            return False
        name = pname(n)
        if name in _CENTRED:
            out = True
        elif name in ("rms_norm", "_fused_rms_norm") or name in ("mul", "div") and _norm_scale(n):
            out = gained or _gain(ep, n)
        elif name in LINEAR:
            out = False
        else:
            ins = [n.args[0]] if name in _LIKE else \
                [a for a in n.all_input_nodes if not is_constant(ep, a)]  # (*_as: a shape only)
            g = gained or _gain(ep, n)
            out = bool(ins) and all(covered(a, g) for a in ins)
        memo[n, gained] = out
        return out
    before = all(covered(a, False) for r in rotations for a in r.all_input_nodes if not is_constant(ep, a))
    # or after them (HunYuan's query/key RMS norms with gains on the rotated head)
    blocked = bool(rotations) and (before or covered(node, False))
    return blocked, bool(rotations)


_LIKE = {"type_as", "to", "_to_copy", "expand_as", "view_as", "reshape_as"}


def _norm_scale(n) -> bool:
    """Whether ``n`` (a mul or div) scales its input by a norm of it: an operand with a unit last
    axis made from an ``rsqrt``, ``sqrt``, power or vector norm (RMS norm, L2 normalisation)."""
    so = node_shape(n)
    for a in n.all_input_nodes:
        sa = node_shape(a)
        if not so or not sa or sa[-1] != 1 or so[-1] == 1:
            continue
        stack, seen = [a], set()
        while stack and len(seen) < 12:
            m = stack.pop()
            if m in seen or not hasattr(m, "op") or m.op != "call_function":
                continue
            seen.add(m)
            if pname(m) in ("rsqrt", "sqrt", "norm", "linalg_vector_norm", "pow"):
                return True
            stack.extend(m.all_input_nodes)
    return False
