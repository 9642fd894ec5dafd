"""Circuit-space merging (Theus et al. 2025): interpolate each attention head's two bilinear
forms, ``QKᵀ`` and ``OV``, instead of its factors.

Theus et al. rewrite every head as ``(d+1)``-wide circuit matrices before interpolating. The same
function needs only a head N times as wide (N models, mixing weights ``w_i``): on the
query/key side ``Q = [√w_1·Q_1; …; √w_N·Q_N]`` and ``K = [√w_1·K_1; …]`` (biases included), so
``q·k = Σ w_i q_i·k_i``; on the value/output side ``V = [√w_i·V_i]`` and ``O = [√w_i·O_i]``, so
``O·V = Σ w_i O_i V_i``; the wider head's softmax scale is folded into the query side
(``√N``). Every other weight is the weighted average. The merge is the parents' model class
where its config can state a head size (``head_dim``: :mod:`symgraph.width.heads`), else their
traced program with the head classes widened (:mod:`symgraph.width.widen`), in memory only.
The heads are found from the report, never from module names.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..core.devices import meta_model
from ..errors import InputError
from ..width.heads import check_config, why_no_config, wide_config, wide_model
from .engine.slicing import keys_of

__all__ = ["widened_program", "circuit_state", "CircuitPlan", "plan", "why_no_config", "wide_model", "wide_shapes",
           "Widening", "CircuitHeads"]


class CircuitPlan:
    """Which parameters widen, and how (from one model's report).

    ``slots``: ``{param: (dim, axis tree, scale on the query side)}``; ``wide``: ``{group id:
    rope half or None}`` of the head-size classes that widen."""

    def __init__(self, slots: dict, wide: dict, head_dim: int, rope: bool):
        self.slots, self.wide, self.head_dim, self.rope = slots, wide, head_dim, rope


def plan(report, query_scale: bool = True) -> CircuitPlan:
    """The widening of every attention head of ``report``'s model: the head-size classes of
    its attention ops and every parameter axis they are part of (packed ones too).
    ``query_scale``: fold the wider head's softmax scale (``√N``) into the query side."""
    by_gid = {g.id: g for g in report.groups}
    sites = report.attention_groups()
    if not sites:
        raise InputError(f"{report.model_name} has no attention op (scaled_dot_product_attention) whose "
                         "heads the analysis found; circuit-space merging needs attention heads")
    wide, sizes, qk = {}, set(), set()
    for s in sites:
        for role in ("qk", "vo"):
            g = by_gid.get(s[role])
            if g is None or not g.outer:  # not fibred over a head class
                raise InputError(f"attention op {s['node']}: its {role.upper()} head size is not a per-head "
                                 "class of the report; expected heads the analysis resolves (GL or RoPE per head)")
            wide[g.id] = _rope_half(g) if g.kind == "rope" else None
            sizes.add(g.dim)
            if role == "qk":
                qk.add(g.id)
    if len(sizes) != 1:
        raise InputError(f"attention head sizes differ across layers ({sorted(sizes)}); expected one head size")
    slots = {}
    for param in report.parameters + report.buffers:
        for dim, axis in enumerate(report.param_axes(param)):
            tree = report.axis_tree(axis)
            found = _leaves(tree, wide)
            if not found:
                continue
            if param in slots:
                raise InputError(f"{param} carries heads on two axes; expected one")
            qside = False
            if query_scale and any(gid in qk for gid in found):
                gid = next(g for g in found if g in qk)
                if len(found) > 1:
                    raise InputError(f"{param} dim {dim} packs query and key heads; the wider head's softmax "
                                     "scale cannot be folded into its query side")
                g = by_gid[gid]
                qside = g.variance[g.params.index((param, dim))] == "co"
            slots[param] = (dim, tree, qside)
    return CircuitPlan(slots, wide, sizes.pop(), any(h is not None for h in wide.values()))


def _leaves(tree, wide) -> list:
    if tree[0] == "leaf":
        return [tree[2]] if tree[2] in wide else []
    return [g for t in tree[1] for g in _leaves(t, wide)]


def _rope_half(g) -> int:
    pairs = [tuple(p) for p in (g.pairs or ())]
    half = g.dim // 2
    if pairs != [(i, i + half) for i in range(half)]:
        raise InputError(f"group {g.id}: RoPE pairs {pairs[:3]}... are not (i, i + d/2); the widened head "
                         "keeps pairs only in the rotate-half layout")
    return half


def _widen(ts, dim, tree, weights, scales, wide):
    """The merged tensor along ``dim`` (structure ``tree``) from the models' ``ts``: a widened
    head-size leaf concatenates the models' scaled coordinates (with RoPE, the models' first
    halves then their second halves, so pair ``(j, j + N·d/2)`` is a pair of one model); a
    part without a widened leaf is the weighted average; sums and products recurse."""
    if not _leaves(tree, wide):
        return sum(w * t for w, t in zip(weights, ts))
    kind, sub = tree[0], tree[1]
    if kind == "leaf":
        parts = [s * t for s, t in zip(scales, ts)]
        half = wide[tree[2]]
        if half is not None:
            parts = [p.narrow(dim, 0, half) for p in parts] + [p.narrow(dim, half, half) for p in parts]
        return torch.cat(parts, dim)
    sizes = [_wide(t, wide, 1) for t in sub]
    if kind == "sum":
        pieces = [t.split(sizes, dim) for t in ts]
        return torch.cat([_widen([p[j] for p in pieces], dim, part, weights, scales, wide)
                          for j, part in enumerate(sub)], dim)
    carriers = [j for j, part in enumerate(sub) if _leaves(part, wide)]
    if len(carriers) != 1:
        raise InputError(f"an axis is a product of {len(carriers)} head sizes; expected one")
    j = carriers[0]
    split = [t.reshape(*t.shape[:dim], *sizes, *t.shape[dim + 1:]) for t in ts]
    out = _widen(split, dim + j, sub[j], weights, scales, wide)
    return out.flatten(dim, dim + len(sizes) - 1)


def circuit_state(states, weights, cplan: CircuitPlan) -> dict:
    """The merged ``{name: tensor}``: widened heads for the planned slots, the weighted average
    elsewhere (``states``: the aligned models' tensors, one dict per model)."""
    n = len(states)
    out = {}
    for name in states[0]:
        ts = [s[name] for s in states]
        if name not in cplan.slots:
            out[name] = sum(w * t for w, t in zip(weights, ts))
            continue
        dim, tree, qside = cplan.slots[name]
        scales = [math.sqrt(w) * (math.sqrt(n) if qside else 1.0) for w in weights]
        out[name] = _widen(ts, dim, tree, weights, scales, cplan.wide)
    return out


def _wider(report, n) -> dict:
    """``{group id: n × size}`` of ``report``'s head-size classes."""
    dims = {g.id: g.dim for g in report.groups}
    return {g: n * dims[g] for g in plan(report, query_scale=False).wide}


def widened_program(models, weights, report, why: str):
    """The circuit-space merge of ``models`` (aligned, one architecture; ``report`` the anchor's)
    with mixing ``weights`` where no config can state the wider head size (``why``): their traced
    program with the head classes widened (:class:`~symgraph.width.widen.Resized`, in memory
    only; :func:`~symgraph.merging.driver.circuit_merge` runs the others through the engine)."""
    n, A = len(models), models[0]
    cplan = plan(report, query_scale=False)
    if cplan.rope:
        raise InputError(why.replace("the merged model runs in memory only", "and its rotary heads "
                         "need per-pair frequencies a config states; expected a config with head_dim"))
    states = [{k: v.detach().to(torch.promote_types(v.dtype, torch.float32)) for k, v in m.state_dict().items()}
              for m in models]
    dtype = next(A.parameters()).dtype
    merged = {k: v.to(dtype) for k, v in circuit_state(states, [float(w) for w in weights], cplan).items()}
    from ..width.widen import Resized
    return Resized(A, merged, lambda rep: _wider(rep, n), why, key=("circuits", n)).eval()


def _shapes(model) -> dict:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def wide_shapes(cplan: CircuitPlan, cfg, old: dict, want: dict, n: int) -> dict:
    """``{name: shape}``: the parents' shapes ``old`` with heads ``n`` times as wide, refused
    where the model class built from ``cfg`` (its shapes ``want``) disagrees."""
    if set(old) != set(want):
        k = sorted(set(old) ^ set(want))[0]
        raise InputError(f"{type(cfg).__name__} with head_dim {cfg.head_dim} and the parents disagree on "
                         f"tensor {k!r}; expected the parents' tensors, heads widened")
    out = {}
    for name, shape in old.items():
        wide = list(shape)
        if name in cplan.slots:
            dim, tree, _ = cplan.slots[name]
            wide[dim] = _wide(tree, cplan.wide, n)
        if tuple(wide) != want[name]:
            raise InputError(f"{type(cfg).__name__} with head_dim {cfg.head_dim} builds {name} as "
                             f"{want[name]}, not {tuple(wide)}; the config cannot express the wider heads")
        out[name] = tuple(wide)
    return out


@dataclass(frozen=True)
class Widening:
    """What circuit-space heads change in a merge's plan: the shapes written instead of the
    anchor's (``out_shapes``: key -> shape), the output config's fields (``config_updates``) and the
    ``combine`` of a group (``(names, values, stats, weights, report) -> merged``)."""
    out_shapes: dict
    config_updates: dict
    combine: Callable


class CircuitHeads:
    """Circuit-space heads in the merge engine: refuses another method than averaging and a
    config that cannot state the wider heads, and gives the engine its :class:`Widening`
    (:meth:`widening`), whose combine is :func:`circuit_state` with the anchor first. It never
    sees the engine; ``report()`` gives the anchor's analysis once the engine has run it."""

    def __init__(self, config, checkpoints, method: str, report: Callable):
        self.anchor, self.n = int(config.anchor), len(checkpoints)
        self.checkpoint, self.report, self._built = checkpoints[self.anchor], report, None
        if method != "average":
            raise InputError(f"attention='circuits' merges by weighted averaging, not method={method!r}; "
                             "expected method='average' without repair")
        check_config(self.checkpoint.model, self.n)

    def built(self):
        """``(plan, config, meta model)`` of the merge."""
        if self._built is None:
            A = self.checkpoint.model  # on the meta device: a config and shapes, no tensors
            cplan = plan(self.report())  # the engine's Analyze step ran
            cfg = wide_config(A, cplan.head_dim, self.n, cplan.rope)
            self._built = (cplan, cfg, meta_model(type(A), cfg))
        return self._built

    def widening(self) -> Widening:
        """The shapes, config fields and combine of the merge (checked against the model class
        the new config builds)."""
        cplan, cfg, new = self.built()
        A = self.checkpoint  # its stored shapes are its model's (checked when it was opened)
        wide = wide_shapes(cplan, cfg, _shapes(A.model), _shapes(new), self.n)
        out_shapes = {k: wide[name] for name in cplan.slots for k in keys_of(A, name)}
        before = A.model.config.to_dict()
        return Widening(out_shapes, {k: v for k, v in cfg.to_dict().items() if before.get(k) != v}, self.combine)

    def combine(self, names, values, stats, weights, report) -> dict:
        """The merged ``names`` (every model's ``values`` in the anchor's basis, the anchor
        first), by :func:`circuit_state`."""
        order = [self.anchor] + [i for i in range(len(values)) if i != self.anchor]
        return circuit_state([{k: values[i][k] for k in names} for i in order], [weights[i] for i in order],
                             self.built()[0])


def _wide(tree, wide, n) -> int:
    """The size of an axis of structure ``tree`` once its head-size leaves in ``wide`` are
    ``n`` times as wide (what :func:`_widen` makes of it; ``n`` 1: its size)."""
    if tree[0] == "leaf":
        return tree[1] * (n if tree[2] in wide else 1)
    parts = [_wide(t, wide, n) for t in tree[1]]
    return math.prod(parts) if tree[0] == "prod" else sum(parts)
