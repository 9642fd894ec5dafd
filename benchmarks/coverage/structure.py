"""Completeness by structure: the MLPs, attention sites and RoPE a report must cover, read
from the traced graph and the config (never from module names)."""
from __future__ import annotations

import collections

from symgraph.passes.nodes import live_nodes
from symgraph.passes.trace import output_positions

from .attention import ROPE_ABSENT, ROPE_BLOCKED, attention_units
from .graph import LINEAR, is_constant, linear_weight, node_shape, pname, users_of
from .why import explain

_TRIG = {"sin", "cos", "polar", "view_as_complex"}
_STOP = {"scaled_dot_product_attention", "softmax", "_softmax", "log_softmax", "_log_softmax",
         "layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm",
         "native_group_norm", "embedding", "mean", "sum", "amax", "amin", "var", "var_mean", "std",
         "topk", "sort", "argmax", "cat", "stack", "index_add", "index_add_", "scatter_add",
         "scatter", "index_put", "index_put_", "cumsum", "max", "min"}
NONLINEAR = {"gelu", "silu", "relu", "tanh", "sigmoid", "erf", "exp", "pow", "leaky_relu", "elu",
              "hardswish", "hardsigmoid", "hardtanh", "mish", "softplus", "relu6", "clamp",
              "clamp_min", "clamp_max", "sin", "cos", "abs", "log_sigmoid", "celu", "selu", "glu",
              "rsqrt", "sqrt", "reciprocal", "log", "square", "prelu", "_prelu_kernel", "where",
              "maximum", "minimum", "sign"}
PERMLIKE = {"perm", "scaled_perm", "signed_perm", "orthogonal", "orthogonal_mean", "gl"}


def _coordinates(users, lin) -> set:
    """Linear-like ops whose outputs are coordinates, not hidden units: they reach the graph's
    outputs (a detection head's boxes) or the positions ``grid_sampler_2d`` samples (deformable
    attention) through no linear-like op, norm or reduction; each channel is read as itself."""
    out = set()
    for up in lin:
        stack, seen = [up], {up}
        while stack and up not in out:
            node = stack.pop()
            for u in users[node]:
                name = pname(u)
                if u.op == "output" or name == "grid_sampler_2d" and u.args[1] is node:
                    out.add(up)
                    break
                if u.op != "call_function" or u in lin or name in _STOP - {"cat", "stack"} \
                        or name in LINEAR or u in seen:
                    continue
                seen.add(u)
                stack.append(u)
    return out


def _width(ep, slot):
    """The size of a parameter's dim (``(param, dim)``), None when the program does not say."""
    t = ep.state_dict.get(slot[0]) if slot else None
    return tuple(t.shape)[slot[1]] if t is not None and slot[1] < t.dim() else None


def _coded(node, depth: int = 16) -> bool:
    """Whether ``node``'s channels are a code stacking distinct functions of its inputs (DAB-DETR's
    sine embedding of box coordinates), found back to a ``stack`` before any linear-like op:
    hidden units gated by it read each channel as a different function."""
    stack, seen = [node], set()
    while stack and len(seen) < 4 * depth:
        n = stack.pop()
        if not hasattr(n, "op") or n in seen or n.op != "call_function":
            continue
        seen.add(n)
        name = pname(n)
        if name == "stack":
            return True
        if name in LINEAR or name in _STOP - {"cat"}:
            continue
        stack += n.all_input_nodes
    return False


def mlp_units(ep, live=None) -> list:
    """Every MLP of the graph: ``{"module", "up": [(param, out dim)], "down": (param, in dim)}``
    for each linear-like op (the down projection) that a linear-like op (an up projection, not
    one of :func:`_coordinates`) reaches through elementwise ops including a nonlinearity, with
    no residual add, norm, attention, softmax or reduction on the way, equal up and down widths,
    and no gate by a stacked code (:func:`_coded`). ``live``: the nodes reaching a kept output
    (:func:`symgraph.passes.nodes.live_nodes`); an MLP whose down projection is not among them is
    dead code and left out."""
    users = users_of(ep)
    lin = {n: w for n in ep.graph.nodes if n.op == "call_function" and (w := linear_weight(ep, n)) is not None}
    units = {}
    coordinates = _coordinates(users, lin)
    for up, (_, up_out, _) in lin.items():
        if up in coordinates:
            continue
        stack, seen = [(up, False)], set()
        while stack:
            node, nl = stack.pop()
            for u in users[node]:
                if u.op != "call_function":
                    continue
                name = pname(u)
                if u in lin:
                    if nl and lin[u][0] is node and (live is None or u in live) \
                            and _width(ep, up_out) == _width(ep, lin[u][2]):
                        unit = units.setdefault(u, {"module": ".".join(lin[u][2][0].split(".")[:-2]),
                                                    "up": [], "down": lin[u][2]})
                        if up_out not in unit["up"]:
                            unit["up"].append(up_out)
                    continue
                if name in _STOP or name in LINEAR:
                    continue
                varying = [a for a in u.all_input_nodes if a is not node and not is_constant(ep, a)] \
                    if name in ("add", "sub", "mul", "div", "rsub", "add_", "mul_") else []
                if varying and name in ("add", "sub", "rsub", "add_"):
                    continue  # a residual (or a merge of branches): not inside one MLP
                if any(_coded(a) for a in varying):
                    continue  # gated by a code: each channel its own function, none exchangeable
                nl2 = nl or name in NONLINEAR or bool(varying)  # varying: a gate (SwiGLU / GeGLU)
                if (u, nl2) not in seen:
                    seen.add((u, nl2))
                    stack.append((u, nl2))
    return list(units.values())


def _trig_reaches_attention(ep) -> bool:
    """Whether a sin, cos or complex value flows into an attention (its scores or output)."""
    stack = [n for n in ep.graph.nodes if pname(n) in _TRIG]
    seen = set()
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        name = pname(n) or str(n.target)
        if "scaled_dot_product" in name or "flash_attention" in name or name in ("softmax", "_softmax"):
            return True
        stack.extend(n.users)
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


def expectations(ep, report, cfg, tied=()) -> dict:
    """What a complete report must contain (the package docstring's step 6), derived from the
    graph and the config, and what this one lacks: ``{"mlps", "attention", "rope_expected",
    "rope_classes", "missing": [{"kind": "mlp-perm" | "attention-heads" | "rope", "module", "why"}]}``.
    ``tied``: groups of names of one tensor (``symgraph.tied_parameters``), read under any name."""
    alias = {n: g for g in tied for n in g}
    headed = {p for g in report.groups if g.blocks > 1 for p, _ in g.params}  # in a class with head blocks
    shapes = {ep.graph_signature.inputs_to_parameters[n.name]: node_shape(n) for n in ep.graph.nodes
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
        got = {g for q in alias.get(p, (p,)) for g in by_slot.get((q, d), ())}
        shp = shapes.get(p) or ()
        if len(shp) >= 3 and d < len(shp):  # a fused gate/up tensor holds the class twice
            got |= by_stacked.get((p, shp[d]), set())
            if shp[d] % 2 == 0:
                got |= by_stacked.get((p, shp[d] // 2), set())
        return got
    # units no kept output depends on (LLaVA's last vision layer under vision_feature_layer=-2)
    # are dead code: any map of their weights keeps the function, none is expected
    live = live_nodes(ep.graph, output_positions(ep, getattr(report, "outputs", None)))
    missing = []
    mlps = mlp_units(ep, live)
    for u in mlps:
        down = holders(tuple(u["down"]))
        if not any(down & holders(tuple(s)) for s in u["up"]):
            missing.append({"kind": "mlp-perm", "module": u["module"],
                            "slots": [list(s) for s in u["up"]] + [list(u["down"])]})
    every = attention_units(ep)
    atts = [a for a in every if a["query"] in live]
    for a in atts:
        if a["heads"] < 2:
            continue
        inside = lambda p: not a["module"] or p.startswith(a["module"] + ".")  # noqa: E731 (root: every param)
        # heads sharing one map inside them (multi-query, MViTv2's pooling kernel) cannot move per
        # head: complete as a permutation class of the head count on a factor of a projection's axis
        ok = any(inside(p) for p in headed) or any(
            g.kind in PERMLIKE and g.dim == a["heads"] and any(
                inside(p) and (shapes.get(p) or ())[d:d + 1] != (g.dim,) for p, d in g.params)
            for g in report.groups)
        if not ok:
            missing.append({"kind": "attention-heads", "module": a["module"], "heads": a["heads"]})
    rope_cfg = has_rope(cfg) and bool(atts)
    rope_classes = sum(g.kind == "rope" for g in report.groups)
    # every site rotating its queries normalises them past RoPE's reach: no rope class can exist
    rot = [a for a in atts if a["rotated"]]
    blocked = bool(rot) and all(a["qk_norm"] for a in rot)
    absent = not rot and not _trig_reaches_attention(ep)  # nothing rotates
    rope_expected = rope_cfg and not blocked and not absent
    if rope_expected and not rope_classes:
        missing.append({"kind": "rope", "module": ""})
    explain(ep, report, missing)  # what blocks each, from the analysis
    return {"mlps": len(mlps), "attention": len(atts), "dead_attention": len(every) - len(atts),
            "qk_norm": sum(a["qk_norm"] for a in atts),
            "multihead_attention": sum(a["heads"] > 1 for a in atts),
            "multi_query": sum(a.get("kv_heads") == 1 and a["heads"] > 1 for a in atts),
            "rope_expected": rope_expected, "rope_classes": rope_classes,
            **({"rope_blocked": ROPE_BLOCKED} if rope_cfg and blocked else {}),
            **({"rope_blocked": ROPE_ABSENT} if rope_cfg and absent else {}), "missing": missing}
