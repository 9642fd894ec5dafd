"""Reading a traced graph for the completeness check: op names, shapes, module paths, users,
the parameter a dimension reads, constants."""
from __future__ import annotations

import collections
import math
import weakref

_PASS = {"t", "transpose", "permute", "_to_copy", "clone", "contiguous", "alias", "detach", "expand",
         "lift_fresh_copy", "index", "select", "unsqueeze", "view", "reshape", "_unsafe_view", "to",
         "type_as", "expand_as"}
#: linear-like ops: (activation arg, weight arg, weight's output dim, weight's input dim)
LINEAR = {"linear": (0, 1, 0, 1), "addmm": (1, 2, 1, 0), "mm": (0, 1, 1, 0), "bmm": (0, 1, 2, 1),
           "matmul": (0, 1, -1, -2), "baddbmm": (1, 2, 2, 1), "convolution": (0, 1, 0, 1),
           "conv1d": (0, 1, 0, 1), "conv2d": (0, 1, 0, 1), "conv3d": (0, 1, 0, 1)}


def pname(n) -> str | None:
    p = getattr(n.target, "overloadpacket", None)
    return getattr(p, "__name__", None) if p is not None else None


def node_shape(n):
    v = n.meta.get("val") if hasattr(n, "meta") else None
    return tuple(v.shape) if hasattr(v, "shape") else None


def users_of(ep) -> dict:
    """``{node: [nodes reading it]}`` of the program's graph."""
    users = collections.defaultdict(list)
    for n in ep.graph.nodes:
        for a in n.all_input_nodes:
            users[a].append(n)
    return users


def module_paths(n) -> list:
    """Module paths of ``n``, innermost first (torch.export's ``nn_module_stack``)."""
    out = []
    for path, _ in reversed(list((n.meta.get("nn_module_stack") or {}).values())):
        path = path.replace("L['self'].", "").replace("L['self']", "")
        path = path.replace("[", ".").replace("]", "").replace("'", "").strip(".")
        out.append(path)
    return out


LAYOUT_OPS = ("transpose", "permute", "unsqueeze")


def dim_before(node, name: str, dim: int, ndim: int):
    """The input's dimension that dimension ``dim`` of ``node`` (``ndim`` dimensions, made by
    layout op ``name`` of :data:`LAYOUT_OPS`) comes from; None for a dimension ``unsqueeze``
    made."""
    if name == "transpose":
        a, b = (d % ndim for d in node.args[1:3])
        return b if dim == a else a if dim == b else dim
    if name == "permute":
        return list(node.args[1])[dim] % ndim
    d = node.args[1] % ndim  # unsqueeze
    return None if dim == d else dim - (dim > d)


def slot_source(ep, node, dim):
    """The ``(parameter, dim)`` that ``node``'s dimension ``dim`` reads, walking back through
    copies, transposes, views and expert gathers; None if it is not a parameter's."""
    params = ep.graph_signature.inputs_to_parameters
    for _ in range(32):
        if not hasattr(node, "op"):
            return None
        if node.op == "placeholder":
            return (params[node.name], dim) if node.name in params else None
        name, shape = pname(node), node_shape(node)
        if name not in _PASS or shape is None or not node.args or not hasattr(node.args[0], "op"):
            return None
        src = node.args[0]
        sshape = node_shape(src)
        if sshape is None:
            return None
        dim %= max(len(shape), 1)
        if name == "t":
            dim = 1 - dim if len(shape) == 2 else dim
        elif name in LAYOUT_OPS:
            dim = dim_before(node, name, dim, len(shape))
            if dim is None:
                return None
        elif name == "select":
            if dim >= node.args[1] % len(sshape):
                dim += 1
        elif name == "index":
            idx = node.args[1]
            if len(shape) != len(sshape) or dim < len(idx):
                return None
        elif name in ("view", "reshape", "_unsafe_view"):
            tail = math.prod(shape[dim + 1:])
            match = [d for d in range(len(sshape)) if sshape[d] == shape[dim]
                     and math.prod(sshape[d + 1:]) == tail]
            if not match:
                return None
            dim = match[0]
        elif name in ("expand", "expand_as") and len(shape) != len(sshape):
            return None
        node = src
    return None


_KNOWN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per program: its user inputs, answers


def is_constant(ep, node) -> bool:
    """Whether ``node`` is a parameter, buffer or constant (or a scalar), not an activation; kept
    per program and node (a residual quantizer's chain of 32 subtractions, asked afresh, took minutes)."""
    if not hasattr(node, "op"):
        return True
    users, known = _KNOWN.setdefault(ep, (frozenset(ep.graph_signature.user_inputs), {}))
    if node not in known:
        known[node] = _walk(ep, node, users)
    return known[node]


def _walk(ep, node, users) -> bool:
    seen = 0
    while hasattr(node, "op") and seen < 32:
        if node.op == "placeholder":
            return node.name not in users
        if node.op == "get_attr":
            return True
        ins = node.all_input_nodes
        if not ins:
            return True
        if len(ins) > 1:
            return all(is_constant(ep, a) for a in ins)
        node, seen = ins[0], seen + 1
    return False


def _from_param(ep, node) -> bool:
    s = node_shape(node) if hasattr(node, "op") else None
    return bool(s) and any(slot_source(ep, node, d) is not None for d in range(len(s)))


def linear_weight(ep, n):
    """``(activation arg, (param, out dim), (param, in dim))`` of a linear-like op whose weight
    is a parameter, else None."""
    spec = LINEAR.get(pname(n))
    if spec is None or len(n.args) <= max(spec[0], spec[1]):
        return None
    a, w, od, idim = spec
    if pname(n) in ("mm", "bmm", "matmul") and not _from_param(ep, n.args[1]) \
            and _from_param(ep, n.args[0]):
        a, w, od, idim = 1, 0, -2, -1  # weight on the left: W @ x
    if pname(n) == "convolution" and (len(n.args) > 8 and n.args[8] != 1 or n.args[6]):
        return None  # grouped / transposed convolution
    if pname(n) in ("conv1d", "conv2d", "conv3d") and len(n.args) > 6 and n.args[6] != 1:
        return None
    wn = n.args[w]
    ws = node_shape(wn) if hasattr(wn, "op") else None
    if ws is None:
        return None
    out = slot_source(ep, wn, od % len(ws))
    inn = slot_source(ep, wn, idim % len(ws))
    if out is None or inn is None:
        return None
    return n.args[a], out, inn
