"""Completeness by structure: the MLPs, attention sites and RoPE a report must cover, read
from the traced graph and the config (never from module names)."""
from __future__ import annotations


import collections
import math




# --- completeness by structure ----------------------------------------------------------------

_PASS = {"t", "transpose", "permute", "_to_copy", "clone", "contiguous", "alias", "detach", "expand",
         "lift_fresh_copy", "index", "select", "unsqueeze", "view", "reshape", "_unsafe_view", "to",
         "type_as", "expand_as"}
#: linear-like ops: (activation arg, weight arg, weight's output dim, weight's input dim)
_LINEAR = {"linear": (0, 1, 0, 1), "addmm": (1, 2, 1, 0), "mm": (0, 1, 1, 0), "bmm": (0, 1, 2, 1),
           "matmul": (0, 1, -1, -2), "baddbmm": (1, 2, 2, 1), "convolution": (0, 1, 0, 1),
           "conv1d": (0, 1, 0, 1), "conv2d": (0, 1, 0, 1), "conv3d": (0, 1, 0, 1)}
_STOP = {"scaled_dot_product_attention", "softmax", "_softmax", "log_softmax", "_log_softmax",
         "layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm",
         "native_group_norm", "embedding", "mean", "sum", "amax", "amin", "var", "var_mean", "std",
         "topk", "sort", "argmax", "cat", "stack", "index_add", "index_add_", "scatter_add",
         "scatter", "index_put", "index_put_", "cumsum", "max", "min"}
_NONLINEAR = {"gelu", "silu", "relu", "tanh", "sigmoid", "erf", "exp", "pow", "leaky_relu", "elu",
              "hardswish", "hardsigmoid", "hardtanh", "mish", "softplus", "relu6", "clamp",
              "clamp_min", "clamp_max", "sin", "cos", "abs", "log_sigmoid", "celu", "selu", "glu",
              "rsqrt", "sqrt", "reciprocal", "log", "square", "prelu", "_prelu_kernel", "where",
              "maximum", "minimum", "sign"}
PERMLIKE = {"perm", "scaled_perm", "signed_perm", "orthogonal", "orthogonal_mean", "gl"}


def _pname(n) -> str | None:
    p = getattr(n.target, "overloadpacket", None)
    return getattr(p, "__name__", None) if p is not None else None


def _shape(n):
    v = n.meta.get("val") if hasattr(n, "meta") else None
    return tuple(v.shape) if hasattr(v, "shape") else None


def _module_paths(n) -> list:
    """Module paths of ``n``, innermost first (torch.export's ``nn_module_stack``)."""
    out = []
    for path, _ in reversed(list((n.meta.get("nn_module_stack") or {}).values())):
        path = path.replace("L['self'].", "").replace("L['self']", "")
        path = path.replace("[", ".").replace("]", "").replace("'", "").strip(".")
        out.append(path)
    return out


def _source(ep, node, dim):
    """The ``(parameter, dim)`` that ``node``'s dimension ``dim`` reads, walking back through
    copies, transposes, views and expert gathers; None if it is not a parameter's."""
    params = ep.graph_signature.inputs_to_parameters
    for _ in range(32):
        if not hasattr(node, "op"):
            return None
        if node.op == "placeholder":
            return (params[node.name], dim) if node.name in params else None
        name, shape = _pname(node), _shape(node)
        if name not in _PASS or shape is None or not node.args or not hasattr(node.args[0], "op"):
            return None
        src = node.args[0]
        sshape = _shape(src)
        if sshape is None:
            return None
        dim %= max(len(shape), 1)
        if name == "t":
            dim = 1 - dim if len(shape) == 2 else dim
        elif name == "transpose":
            a, b = (d % len(shape) for d in node.args[1:3])
            dim = b if dim == a else a if dim == b else dim
        elif name == "permute":
            dim = list(node.args[1])[dim] % len(shape)
        elif name == "select":
            if dim >= node.args[1] % len(sshape):
                dim += 1
        elif name == "unsqueeze":
            d = node.args[1] % len(shape)
            if dim == d:
                return None
            dim -= dim > d
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


def _is_constant(ep, node) -> bool:
    """Whether ``node`` is a parameter, buffer or constant (or a scalar), not an activation."""
    if not hasattr(node, "op"):
        return True
    sig = ep.graph_signature
    seen = 0
    while hasattr(node, "op") and seen < 32:
        if node.op == "placeholder":
            return node.name not in set(sig.user_inputs)
        if node.op == "get_attr":
            return True
        ins = [a for a in node.all_input_nodes]
        if not ins:
            return True
        if len(ins) > 1:
            return all(_is_constant(ep, a) for a in ins)
        node, seen = ins[0], seen + 1
    return False


def _from_param(ep, node) -> bool:
    s = _shape(node) if hasattr(node, "op") else None
    return bool(s) and any(_source(ep, node, d) is not None for d in range(len(s)))


def _linear_weight(ep, n):
    """``(activation arg, (param, out dim), (param, in dim))`` of a linear-like op whose weight
    is a parameter, else None."""
    spec = _LINEAR.get(_pname(n))
    if spec is None or len(n.args) <= max(spec[0], spec[1]):
        return None
    a, w, od, idim = spec
    if _pname(n) in ("mm", "bmm", "matmul") and not _from_param(ep, n.args[1]) \
            and _from_param(ep, n.args[0]):
        a, w, od, idim = 1, 0, -2, -1  # weight on the left: W @ x
    if _pname(n) == "convolution" and (len(n.args) > 8 and n.args[8] != 1 or n.args[6]):
        return None  # grouped / transposed convolution
    if _pname(n) in ("conv1d", "conv2d", "conv3d") and len(n.args) > 6 and n.args[6] != 1:
        return None
    wn = n.args[w]
    ws = _shape(wn) if hasattr(wn, "op") else None
    if ws is None:
        return None
    out = _source(ep, wn, od % len(ws))
    inn = _source(ep, wn, idim % len(ws))
    if out is None or inn is None:
        return None
    return n.args[a], out, inn


def mlp_units(ep) -> list:
    """Every MLP of the graph: ``{"module", "up": [(param, out dim)], "down": (param, in dim)}``
    for each linear-like op (the down projection) that a linear-like op (an up projection)
    reaches through elementwise ops including a nonlinearity, with no residual add, norm,
    attention, softmax or reduction on the way."""
    users = collections.defaultdict(list)
    for n in ep.graph.nodes:
        for a in n.all_input_nodes:
            users[a].append(n)
    lin = {}
    for n in ep.graph.nodes:
        if n.op == "call_function":
            w = _linear_weight(ep, n)
            if w is not None:
                lin[n] = w
    units = {}
    for up, (_, up_out, _) in lin.items():
        stack, seen = [(up, False)], set()
        while stack:
            node, nl = stack.pop()
            for u in users[node]:
                if u.op != "call_function":
                    continue
                name = _pname(u)
                if u in lin:
                    if nl and lin[u][0] is node:
                        unit = units.setdefault(u, {"module": ".".join(lin[u][2][0].split(".")[:-2]),
                                                    "up": [], "down": lin[u][2]})
                        if up_out not in unit["up"]:
                            unit["up"].append(up_out)
                    continue
                if name in _STOP or name in _LINEAR:
                    continue
                nl2 = nl or name in _NONLINEAR
                if name in ("add", "sub", "mul", "div", "rsub", "add_", "mul_"):
                    others = [a for a in u.all_input_nodes if a is not node]
                    varying = [a for a in others if not _is_constant(ep, a)]
                    if varying and name in ("add", "sub", "rsub", "add_"):
                        continue  # a residual (or a merge of branches): not inside one MLP
                    if varying and name in ("mul", "div", "mul_"):
                        nl2 = True  # a gate (SwiGLU / GeGLU)
                if (u, nl2) not in seen:
                    seen.add((u, nl2))
                    stack.append((u, nl2))
    return list(units.values())


def attention_units(ep) -> list:
    """Every attention site: ``{"module", "heads"}`` for each ``scaled_dot_product_attention``
    (heads: dim 1 of the query) and each softmax over a >= 4-d tensor (heads: its dim 1), with
    the innermost module that holds parameters. One per module."""
    params = list(ep.graph_signature.inputs_to_parameters.values())
    out = {}
    for n in ep.graph.nodes:
        if n.op != "call_function":
            continue
        name = _pname(n) or str(n.target)
        if "scaled_dot_product" in name or "flash_attention" in name:
            s = _shape(n.args[0]) if n.args and hasattr(n.args[0], "op") else None
            query = n.args[0]
        elif name in ("softmax", "_softmax"):
            s = _shape(n)
            s = s if s is not None and len(s) >= 4 else None
            query = n
        else:
            continue
        if s is None or len(s) < 4:
            continue
        module = next((p for p in _module_paths(n) if p and any(q.startswith(p + ".") for q in params)), "")
        if module not in out:
            out[module] = {"module": module, "heads": int(s[1]), "qk_norm": _normalised(ep, query)}
    return list(out.values())


_NORMS = {"rsqrt", "rms_norm", "_fused_rms_norm", "layer_norm", "native_layer_norm", "norm",
          "linalg_vector_norm", "group_norm", "native_group_norm"}


def _normalised(ep, node) -> bool:
    """Whether a norm lies between the projection that makes ``node`` (the query, or the
    scores) and ``node``: per-dimension gains of a query/key norm do not commute with RoPE's
    rotations, so such models admit no ``rope`` class (only a discrete subgroup of it)."""
    stack, seen = [node], set()
    while stack and len(seen) < 400:
        n = stack.pop()
        if n in seen or not hasattr(n, "op") or n.op != "call_function":
            continue
        seen.add(n)
        name = _pname(n)
        if name in _NORMS:
            return True
        if name in _LINEAR and n is not node:
            continue
        stack.extend(a for a in n.all_input_nodes if not _is_constant(ep, a))
    return False


def has_rope(cfg) -> bool:
    """Whether the config (or a sub-config) declares rotary position embeddings."""
    from transformers import PretrainedConfig
    for k, v in vars(cfg).items():
        if isinstance(v, PretrainedConfig):
            if has_rope(v):
                return True
        elif k in ("rope_parameters", "rope_scaling") and isinstance(v, dict) and v:
            if any(isinstance(x, dict) and x for x in v.values()) or v.get("rope_type") or v.get("rope_theta"):
                return True
        elif k in ("rotary_dim", "rotary_pct", "partial_rotary_factor", "rotary_emb_base", "rope_theta",
                   "rotary_emb_fraction", "rotary_value") and v and not isinstance(v, bool):
            return True
        elif k == "position_embedding_type" and isinstance(v, str) and v.lower() in ("rotary", "rope"):
            return True
    return False


def expectations(ep, report, cfg) -> dict:
    """What a complete report must contain, derived from the graph and the config, and what
    this one lacks: ``{"mlps", "attention", "rope_expected", "rope_classes", "missing": [...]}``.
    Each missing entry is ``{"kind": "mlp-perm" | "attention-heads" | "rope", "module": ...}``."""
    slots = collections.defaultdict(set)   # (param, dim) -> kinds of the groups holding it
    headed = set()                         # params in a class with head blocks
    for g in report.groups:
        for p, d in g.params:
            slots[(p, d)].add(g.kind)
        if g.blocks > 1:
            headed.update(p for p, _ in g.params)
    shapes = {ep.graph_signature.inputs_to_parameters[n.name]: _shape(n) for n in ep.graph.nodes
              if n.op == "placeholder" and n.name in ep.graph_signature.inputs_to_parameters}
    by_slot = collections.defaultdict(set)
    by_stacked = collections.defaultdict(set)  # (param, size) -> groups: stacked (>= 3-d) params
    for g in report.groups:
        if g.kind in PERMLIKE:
            for p, d in g.params:
                by_slot[(p, d)].add(g.id)
                if len(shapes.get(p) or ()) >= 3:
                    by_stacked[(p, g.dim)].add(g.id)

    def holders(slot):
        """Groups on ``slot``; a stacked expert tensor's slots may be reported per expert (in
        another dim numbering), so for those any group of that size on that tensor counts."""
        p, d = slot
        got = set(by_slot.get((p, d), set()))
        shp = shapes.get(p) or ()
        if len(shp) >= 3 and d < len(shp):  # a fused gate/up tensor holds the class twice
            got |= by_stacked.get((p, shp[d]), set())
            if shp[d] % 2 == 0:
                got |= by_stacked.get((p, shp[d] // 2), set())
        return got
    missing = []
    mlps = mlp_units(ep)
    for u in mlps:
        down = holders(tuple(u["down"]))
        if not any(down & holders(tuple(s)) for s in u["up"]):
            missing.append({"kind": "mlp-perm", "module": u["module"],
                            "slots": [list(s) for s in u["up"]] + [list(u["down"])]})
    atts = attention_units(ep)
    for a in atts:
        if a["heads"] > 1 and not any(p.startswith(a["module"] + ".") for p in headed):
            missing.append({"kind": "attention-heads", "module": a["module"], "heads": a["heads"]})
    rope_expected = has_rope(cfg) and bool(atts)
    rope_classes = sum(g.kind == "rope" for g in report.groups)
    if rope_expected and not rope_classes:
        qk = [a for a in atts if a["qk_norm"]]
        missing.append({"kind": "rope", "module": "",
                        **({"why": "query/key norm: its per-dimension gains do not commute with the "
                            "rotations (only a discrete subgroup survives)"} if qk and len(qk) == len(atts) else {})})
    return {"mlps": len(mlps), "attention": len(atts), "qk_norm": sum(a["qk_norm"] for a in atts),
            "multihead_attention": sum(a["heads"] > 1 for a in atts),
            "rope_expected": rope_expected, "rope_classes": rope_classes, "missing": missing}
