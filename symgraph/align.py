"""Alignment: fill every class of the report with a group element or transport map that
carries model B into model A's basis.

Similarity comes from weights (data-free coordinate descent over all classes: Git Re-Basin's
weight matching generalised to rotations and head-structured classes) or from activations
(streamed cross-correlations at each class's observation points, seed 002's recipe). Head
classes are solved jointly with the classes fibred over them (nested matching: an outer
assignment of heads whose cost is each head pair's best inner alignment).
"""
from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from . import solve as S
from .errors import InputError, StructureMismatchError
from .groups import orthogonal_part
from .transform import Map, Perm, _is_perm, apply_along, axis_matrix

# --- coordinate tables ---------------------------------------------------------------------


def coord_table(an, axis):
    """Memoised :func:`_coord_table` (an analysis' structures are final once it is built)."""
    r = an.uf.find(axis)[0]
    memo = an.__dict__.setdefault("_coord_tables", {})
    if r not in memo:
        memo[r] = _coord_table(an, axis)
    return memo[r]


def _coord_table(an, axis):
    """Per coordinate of ``axis``: the index into each leaf class, and a path id that tells
    apart the segments of direct sums. Returns ``(paths [n], {leaf_root: idx [n] or -1})``."""
    uf = an.uf
    r, _ = uf.find(axis)
    n = uf.size[r]
    s = uf.struct.get(r)
    if s is None:
        return np.zeros(n, np.int64), {r: np.arange(n)}
    kind, parts = s
    subs = [coord_table(an, a) for a, _ in parts]
    if kind == "sum":
        paths, leaves, off = [], {}, 0
        for k, (p, t) in enumerate(subs):
            m = len(p)
            paths.append(p * 64 + k + 1)
            for leaf, idx in t.items():
                arr = leaves.setdefault(leaf, np.full(n, -1, np.int64))
                arr[off:off + m] = idx
            off += m
        return np.concatenate(paths), leaves
    sizes = [len(p) for p, _ in subs]
    grids = np.meshgrid(*[np.arange(s_) for s_ in sizes], indexing="ij")
    grids = [g.reshape(-1) for g in grids]
    paths = np.zeros(n, np.int64)
    leaves = {}
    for k, ((p, t), g) in enumerate(zip(subs, grids)):
        paths = paths * 4096 + p[g]
        for leaf, idx in t.items():
            leaves[leaf] = idx[g]
    return paths, leaves


def leaf_views(an, axis, target):
    """Index arrays ``[*fibre_sizes, n_target, *other_leaf_sizes]`` into ``axis``'s coordinates,
    one per occurrence of ``target`` (sorted by path so that two models agree)."""
    paths, leaves = coord_table(an, axis)
    if target not in leaves:
        return []
    fib = [f for f in an.fibre.get(target, ()) if f in leaves]
    out = []
    present = leaves[target] >= 0
    for path in sorted(set(paths[present].tolist())):
        cs = np.nonzero(present & (paths == path))[0]
        others = [leaf for leaf, idx in leaves.items()
                  if leaf != target and leaf not in fib and (idx[cs] >= 0).all()]
        dims = fib + [target] + others
        shape = [an.uf.size[d] for d in dims]
        idx = np.full(shape, -1, np.int64)
        idx[tuple(leaves[d][cs] for d in dims)] = cs
        if (idx < 0).any():
            continue
        out.append((torch.as_tensor(idx), len(fib)))
    return out


# --- the alignment object ------------------------------------------------------------------


@dataclass
class Alignment:
    """Group elements / transport maps for B's classes, keyed by B's class roots."""
    report_a: object
    report_b: object
    elements: dict
    results: dict = field(default_factory=dict)  # group id -> SolveResult
    similarity: str = "weights"
    seconds: dict = field(default_factory=dict)

    def state(self, model_b) -> dict:
        """B's parameters in A's basis (and A's shapes): ``{fqn: tensor}``."""
        an = self.report_b._analysis
        out = {}
        for name, node in an.param_nodes.items():
            p = model_b.get_parameter(name).detach()
            val = p.double()
            for d, a in enumerate(an.node_axes[node]):
                M = axis_matrix(an, a, self.elements)
                if M is not None:
                    val = apply_along(val, d, M)
            out[name] = val.to(p.dtype)
        for keep, others in an.aliases.items():  # tied names share the value
            for o in others:
                out[o] = out[keep]
        return out

    def apply(self, model_b, template=None):
        """A new model computing B's function (exactly, for group elements) in A's basis.

        ``model_b`` is not modified. When widths differ the result has A's architecture
        (``template``, default: a copy of the anchor model given to :func:`align`).
        """
        _check_finite(model_b, "model_b")
        state = self.state(model_b)
        shapes_same = all(tuple(model_b.get_parameter(k).shape) == tuple(v.shape)
                          for k, v in state.items())
        base = template if template is not None else (model_b if shapes_same else self._template)
        new = copy.deepcopy(base)
        with torch.no_grad():
            for k, v in state.items():
                new.get_parameter(k).copy_(v)
            if base is not model_b:  # carry over B's parameters no class touched
                for k, p in model_b.named_parameters():
                    if k not in state and tuple(new.get_parameter(k).shape) == tuple(p.shape):
                        new.get_parameter(k).copy_(p)
        return new

    _template = None
    scales: dict = None  # group id -> per-block scalars fitted by ``rescale=True``


# --- validation ----------------------------------------------------------------------------


def _check_finite(model, label):
    for name, p in model.named_parameters():
        # a sum is finite iff every term is, barring overflow: then check element-wise
        if not p.is_meta and not torch.isfinite(p.detach().sum()) and not torch.isfinite(p).all():
            bad = int((~torch.isfinite(p)).sum())
            raise InputError(f"{label} has {bad} NaN/inf values in parameter {name!r}; "
                             "expected finite weights")


def check_compatible(ra, rb):
    """Same graph structure (sizes may differ on non-fixed classes); name the first difference."""
    ga, gb = ra.groups, rb.groups
    ea, eb = ra._analysis, rb._analysis
    na = [n for n in ea.graph.nodes if n.op == "call_function"]
    nb = [n for n in eb.graph.nodes if n.op == "call_function"]
    for x, y in zip(na, nb):
        if x.target != y.target:
            raise StructureMismatchError(
                f"the models' graphs differ at node {x.name} ({x.target}) vs {y.name} ({y.target}); "
                "expected two models of the same architecture (same ops in the same order)")
    if len(na) != len(nb):
        raise StructureMismatchError(
            f"the models' graphs differ in length ({len(na)} vs {len(nb)} ops); expected the same "
            "architecture and depth")
    pa, pb = list(ea.param_nodes), list(eb.param_nodes)
    if pa != pb:
        diff = next((x, y) for x, y in zip(pa + [None], pb + [None]) if x != y)
        raise StructureMismatchError(f"parameter names differ: {diff[0]!r} vs {diff[1]!r}")
    for name in pa:
        sa = [ea.uf.size[a] for a in ea.node_axes[ea.param_nodes[name]]]
        sb = [eb.uf.size[a] for a in eb.node_axes[eb.param_nodes[name]]]
        for d, (x, y, a) in enumerate(zip(sa, sb, ea.node_axes[ea.param_nodes[name]])):
            if x != y and ea.kind(ea.uf.find(a)[0]) == "identity" and not ea.uf.struct.get(ea.uf.find(a)[0]):
                raise StructureMismatchError(
                    f"parameter {name!r} dim {d} has size {x} in model A and {y} in model B, and "
                    "that axis is fixed (e.g. vocabulary, labels, input features): expected equal "
                    "sizes (mismatched vocabularies?)")
    if len(ga) != len(gb) or any(x.kind != y.kind or bool(x.outer) != bool(y.outer) for x, y in zip(ga, gb)):
        for x, y in zip(ga, gb):
            if x.kind != y.kind:
                raise StructureMismatchError(
                    f"symmetry group {x.id} ({x.module}) is {x.kind} in A but {y.kind} in B")
        raise StructureMismatchError(f"the models have {len(ga)} and {len(gb)} symmetry groups")


# --- similarity from weights ---------------------------------------------------------------


class _WeightFeatures:
    """Similarity of a class from the weights, as a sum of per-slot contributions.

    A slot's contribution depends on the elements of the classes on the parameter's other
    axes (its *dependencies*); contributions are cached with the versions of those elements
    and recomputed only when one of them changed. Weights stay in their own dtype (no float64
    copies of either model): permutation classes rank in that dtype, continuous classes gather
    their (small) slices into float64 so that Procrustes is exact.
    """

    CACHE_NUMEL = 1 << 20  # contributions larger than this (e.g. MLP×MLP) are not kept

    def __init__(self, ra, rb, model_a, model_b):
        self.ra, self.rb = ra, rb
        self.ea, self.eb = ra._analysis, rb._analysis
        self.A = {k: model_a.get_parameter(k).detach() for k in self.ea.param_nodes}
        self.B = {k: model_b.get_parameter(k).detach() for k in self.eb.param_nodes}
        self._cache: dict = {}
        self._deps: dict = {}
        self._axis_memo: dict = {}
        self.versions: dict = {}  # shared with the solve loop: B class root -> changes so far

    def _axis_op(self, a, elements):
        """B's current map on axis ``a``: an index vector for a permutation, else the dense
        matrix; memoised by the versions of the axis' leaf classes."""
        eb = self.eb
        leaves = eb.leaves(a)
        key = (eb.uf.find(a), tuple((r in elements, self.versions.get(r, 0)) for r in leaves))
        hit = self._axis_memo.get(key, False)
        if hit is False:
            M = axis_matrix(eb, a, elements)
            if M is not None and M.dim() > 1 and _is_perm(M):
                M = M.argmax(1)
            hit = M
            if M is None or M.dim() == 1 or M.numel() <= self.CACHE_NUMEL:
                self._axis_memo[key] = hit
        return hit

    def slots(self, ga):
        return list(dict.fromkeys(ga.params))

    def deps(self, gb, name, d):
        """B's leaf classes (other than ``gb`` and its fibres) that the slot's feature uses."""
        key = (gb.root, name, d)
        if key not in self._deps:
            eb = self.eb
            ax = eb.node_axes[eb.param_nodes[name]]
            out = set()
            for k, a in enumerate(ax):
                if k != d:
                    out.update(eb.leaves(a))
            fib = set(eb.fibre.get(gb.root, ()))
            out.update(x for x in eb.leaves(ax[d]) if x != gb.root and x not in fib)
            self._deps[key] = frozenset(out)
        return self._deps[key]

    def similarity(self, ga, gb, elements, cross_fibres: bool, usable=None):
        """``(S, complete, deps)``: ``S [*F_A, *F_B, n_A, n_B]`` (cross_fibres) summed over the
        slots whose dependencies are ``usable`` (all by default); ``complete`` is False when a
        slot was left out; ``deps`` are the classes the used slots depend on."""
        versions = self.versions
        exact = orthogonal_part(ga.kind) not in ("perm", "signed_perm")
        total, na2, nb2, complete, used = None, 0.0, 0.0, True, set()
        for name, d in self.slots(ga):
            dep = self.deps(gb, name, d)
            if usable is not None and not usable(dep):
                complete = False
                continue
            key = (ga.id, name, d, cross_fibres)
            ver = tuple(sorted((r, versions.get(r, 0)) for r in dep))
            hit = self._cache.get(key)
            if hit is None or hit[0] != ver:
                val = self._slot(ga, gb, name, d, elements, cross_fibres, exact)
                if val[0] is not None and val[0].numel() <= self.CACHE_NUMEL and not val[3]:
                    self._cache[key] = (ver, val)
            else:
                val = hit[1]
            s, a2, b2, partial = val
            complete &= not partial
            if s is None:
                continue
            used |= dep
            total = s if total is None else total + s
            na2, nb2 = na2 + a2, nb2 + b2
        if total is not None and total.dim() == 4:
            # per head pair, scale by the features' norms: the matching pair then scores
            # exactly 1 per class and every other pair at most 1 (Cauchy-Schwarz)
            total = total / (na2.clamp_min(1e-30).sqrt()[:, None, None, None]
                             * nb2.clamp_min(1e-30).sqrt()[None, :, None, None])
        return total, complete, frozenset(used)

    def _slot(self, ga, gb, name, d, elements, cross_fibres, exact):
        na, nb = self.ea.param_nodes[name], self.eb.param_nodes[name]
        ax_a, ax_b = self.ea.node_axes[na], self.eb.node_axes[nb]
        total, a2, b2 = None, 0.0, 0.0
        va, vb = leaf_views(self.ea, ax_a[d], ga.root), leaf_views(self.eb, ax_b[d], gb.root)
        others = self._other_leaf_elements(ax_b[d], gb.root, elements) if va else []
        if others is None:  # another leaf of this axis is not solved yet: its order is unknown
            return None, a2, b2, True
        ta, tb = self.A[name], self.B[name]
        if exact:
            ta, tb = ta.double(), tb.double()
        for k, a in enumerate(ax_b):  # other dims into A's basis
            if k == d:
                continue
            M = self._axis_op(a, elements)
            if M is not None:
                tb = apply_along(tb, k, M)
        for (ia, fa), (ib, fb) in zip(va, vb):
            xa = _gather(ta, d, ia, fa)  # [*F, n, m]
            xb = _gather(tb, d, ib, fb, others)
            if xa.shape[-1] != xb.shape[-1]:
                continue
            s = _cross(xa, xb, fa, cross_fibres)
            total = s if total is None else total + s
            if fa and cross_fibres:
                a2 = a2 + (xa.reshape(-1, *xa.shape[fa:]) ** 2).sum((-1, -2))
                b2 = b2 + (xb.reshape(-1, *xb.shape[fb:]) ** 2).sum((-1, -2))
        return total, a2, b2, False

    def _other_leaf_elements(self, axis, target, elements):
        """(position among O, element, fibre positions) for O leaves that have elements."""
        an = self.eb
        paths, leaves = coord_table(an, axis)
        fib = [f for f in an.fibre.get(target, ()) if f in leaves]
        present = leaves[target] >= 0
        others = [leaf for leaf, idx in leaves.items()
                  if leaf != target and leaf not in fib and (idx[present] >= 0).all()]
        out = []
        dims = fib + [target] + others
        for j, leaf in enumerate(others):
            E = elements.get(leaf)
            if E is None:
                if an.kind(leaf) != "identity" and an.uf.size[leaf] > 1:
                    return None
                continue
            E = E.co if isinstance(E, Map) else E.dense() if isinstance(E, Perm) else E
            lf = an.fibre.get(leaf, ())
            if any(f not in dims for f in lf):
                continue
            out.append((j, E, [dims.index(f) for f in lf]))
        return out


def _gather(t, d, idx, nf, others=None):
    """Gather ``t``'s dim ``d`` by ``idx [*F, n, *O]`` → ``[*F, n, m]``; ``others`` holds the
    current elements of the O leaves (applied first, so B's O coordinates are in A's order)."""
    moved = t.movedim(d, 0)
    flat = idx.reshape(-1)
    if nf == 0 and idx.dim() == 1 and len(flat) == moved.shape[0] and bool(
            (flat == torch.arange(len(flat))).all()):
        x = moved  # the whole axis in order: a view, no copy (embeddings)
    else:
        x = moved[flat].reshape(*idx.shape, *moved.shape[1:])
    for pos, E, fpos in (others or []):
        x = _apply_leaf(x, nf + 1 + pos, E, fpos)
    lead = idx.shape[: nf + 1]
    return x.reshape(*lead, -1)


def _apply_leaf(x, pos, E, fpos):
    """Apply ``E [*fibres, a, b]`` along dim ``pos`` of ``x``; fibres index dims ``fpos``."""
    import string
    L = string.ascii_letters
    xs = [L[i] for i in range(x.dim())]
    new = L[x.dim()]
    es = "".join(xs[p] for p in fpos) + new + xs[pos]
    out = [new if i == pos else c for i, c in enumerate(xs)]
    return torch.einsum(f"{es},{''.join(xs)}->{''.join(out)}", E.to(x.dtype), x)


def _cross(xa, xb, nf, cross_fibres):
    if nf == 0:
        return xa @ xb.mT
    fa = xa.reshape(-1, *xa.shape[nf:])  # flatten fibres into one index
    fb = xb.reshape(-1, *xb.shape[nf:])
    if cross_fibres:
        return torch.einsum("aim,bjm->abij", fa, fb)
    return torch.einsum("aim,ajm->aij", fa, fb)


# --- similarity from activations -----------------------------------------------------------


class _Capture(torch.fx.Interpreter):
    def __init__(self, gm, names, sink):
        super().__init__(gm)
        self.names, self.sink = names, sink

    def run_node(self, n):
        out = super().run_node(n)
        if n.name in self.names and isinstance(out, torch.Tensor):
            self.sink(n.name, out)
        return out


_OBS_OPS = ("linear", "addmm", "mm", "matmul", "bmm", "conv", "embedding", "layer_norm", "gelu",
            "relu", "silu", "tanh", "sigmoid", "mul", "add", "scaled_dot_product_attention", "cat")


def _observation_points(an, root, limit=24):
    pts = []
    for node, ax in an.node_axes.items():
        if node.op != "call_function" or an.origin.get(node) != "act" or not ax or isinstance(ax[0], list):
            continue
        name = getattr(node.target, "__name__", str(node.target)).split(".")[0]
        if name not in _OBS_OPS:
            continue
        for k, a in enumerate(ax):
            if root in set(an.leaves(a)):
                # the other axes become samples: they must be fixed (batch, sequence)
                if all(an.kind(leaf) == "identity" for j, b in enumerate(ax) if j != k
                       for leaf in an.leaves(b)):
                    pts.append((node, k))
                break
    if len(pts) > limit:
        sel = np.linspace(0, len(pts) - 1, limit).round().astype(int)
        pts = [pts[i] for i in sorted(set(sel.tolist()))]
    return pts


class _ActStats:
    """Streaming cross-moments of one class's coordinates in A and B."""

    def __init__(self):
        self.n = 0
        self.sa = self.sb = self.saa = self.sbb = self.sab = None

    def add(self, xa, xb, nf):
        # xa [N, *F, n] -> flatten fibres
        xa = xa.reshape(xa.shape[0], -1, xa.shape[-1]) if nf else xa.unsqueeze(1)
        xb = xb.reshape(xb.shape[0], -1, xb.shape[-1]) if nf else xb.unsqueeze(1)
        sab = torch.einsum("tai,tbj->abij", xa, xb)
        upd = (xa.sum(0), xb.sum(0), (xa * xa).sum(0), (xb * xb).sum(0), sab)
        if self.sa is None:
            self.sa, self.sb, self.saa, self.sbb, self.sab = upd
        else:
            self.sa, self.sb, self.saa, self.sbb, self.sab = (
                x + y for x, y in zip((self.sa, self.sb, self.saa, self.sbb, self.sab), upd))
        self.n += xa.shape[0]

    def matrix(self, kind):
        n = max(self.n, 1)
        ma, mb = self.sa / n, self.sb / n
        cov = self.sab / n - torch.einsum("ai,bj->abij", ma, mb)
        if kind in ("orthogonal", "gl", "rope"):
            return cov
        sa = (self.saa / n - ma * ma).clamp_min(1e-12).sqrt()
        sb = (self.sbb / n - mb * mb).clamp_min(1e-12).sqrt()
        return cov / torch.einsum("ai,bj->abij", sa, sb)


def _activation_similarity(ra, rb, data, pairs, max_samples=4096):
    ea, eb = ra._analysis, rb._analysis
    plan = {}  # group index -> list of (node_a, node_b, k)
    nodes_a, nodes_b = list(ea.graph.nodes), list(eb.graph.nodes)
    pos_b = {n: i for i, n in enumerate(nodes_b)}
    for i, (ga, gb) in enumerate(pairs):
        pts = []
        for node_b, k in _observation_points(eb, gb.root):
            node_a = nodes_a[pos_b[node_b]] if pos_b[node_b] < len(nodes_a) else None
            if node_a is None or node_a.target != node_b.target:
                continue
            pts.append((node_a, node_b, k))
        plan[i] = pts
    names_a = {p[0].name for pts in plan.values() for p in pts}
    names_b = {p[1].name for pts in plan.values() for p in pts}
    stats = {i: _ActStats() for i in plan}
    views = {}
    for i, pts in plan.items():
        ga, gb = pairs[i]
        for node_a, node_b, k in pts:
            va = leaf_views(ea, ea.node_axes[node_a][k], ga.root)
            vb = leaf_views(eb, eb.node_axes[node_b][k], gb.root)
            need = len(ea.fibre.get(ga.root, ()))
            # heads on another axis of the tensor, or other leaves mixed in: not a clean view
            ok = [(x, y) for x, y in zip(va, vb)
                  if x[1] == need and x[0].dim() == need + 1 and y[0].dim() == x[0].dim()]
            views[(i, node_a.name)] = ([x for x, _ in ok], [y for _, y in ok], k)
    gm_a, gm_b = ea.ep.module(), eb.ep.module()
    for bi, batch in enumerate(data):
        args, kwargs = _batch_inputs(ra, batch, bi)
        cap_a, cap_b = {}, {}
        with torch.no_grad():
            _run_capture(gm_a, names_a, cap_a, args, kwargs)
            _run_capture(gm_b, names_b, cap_b, args, kwargs)
        for i, pts in plan.items():
            for node_a, node_b, k in pts:
                va, vb, k = views[(i, node_a.name)]
                xa, xb = cap_a[node_a.name].double(), cap_b[node_b.name].double()
                for (ia, fa), (ib, fb) in zip(va, vb):
                    a = _act_gather(xa, k, ia, fa)
                    b = _act_gather(xb, k, ib, fb)
                    if a.shape[0] > max_samples:
                        sel = torch.linspace(0, a.shape[0] - 1, max_samples).long()
                        a, b = a[sel], b[sel]
                    stats[i].add(a, b, fa)
    return stats, plan


def _act_gather(x, k, idx, nf):
    """``x`` gathered along axis ``k`` by ``idx [*F, n, *O]`` → samples ``[N, *F, n]``.

    Every other axis of ``x`` and the other leaves ``O`` of the same axis count as samples.
    """
    moved = x.movedim(k, -1)
    g = moved[..., idx.reshape(-1)].reshape(*moved.shape[:-1], *idx.shape)
    n_o = idx.dim() - nf - 1
    if n_o:
        g = g.movedim(tuple(range(g.dim() - n_o, g.dim())), tuple(range(n_o)))
    keep = idx.shape[: nf + 1]
    return g.reshape(-1, *keep)


def _run_capture(gm, names, sink, args, kwargs):
    def put(name, val):
        sink[name] = val.detach()
    # ExportedProgram.module() is a GraphModule whose forward flattens (args, kwargs)
    interp = _Capture(gm, names, put)
    flat = _flatten_for(gm, args, kwargs)
    interp.run(*flat)


def _flatten_for(gm, args, kwargs):
    import torch.utils._pytree as pytree
    spec = getattr(gm, "_in_spec", None)
    if spec is not None and spec.num_children == 2:
        kw_spec = spec.child(1) if hasattr(spec, "child") else spec.children_specs[1]
        keys = kw_spec.context if kw_spec.context else list(kwargs)
        kwargs = {k: kwargs[k] for k in keys if k in kwargs}
    flat, _ = pytree.tree_flatten((args, kwargs))
    return flat


def _batch_inputs(report, batch, index):
    args, kwargs = report._inputs
    if isinstance(batch, dict):
        b_args, b_kwargs = (), {**{k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}, **batch}
    elif isinstance(batch, torch.Tensor):
        b_args, b_kwargs = (batch,), {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    elif isinstance(batch, (tuple, list)):
        b_args, b_kwargs = tuple(batch), {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
    else:
        raise InputError(f"data batch {index} is a {type(batch).__name__}; expected the same form as "
                         "inputs (a tuple of tensors or a dict of keyword tensors)")
    ex = [t for t in list(args) + list(kwargs.values()) if isinstance(t, torch.Tensor)]
    got = [t for t in list(b_args) + list(b_kwargs.values()) if isinstance(t, torch.Tensor)]
    if len(ex) != len(got) or any(tuple(x.shape) != tuple(y.shape) for x, y in zip(ex, got)):
        raise InputError(
            f"data batch {index} has tensor shapes {[tuple(t.shape) for t in got]}; expected "
            f"{[tuple(t.shape) for t in ex]} (the shapes the models were traced with: every batch "
            "must have the same shapes as the first)")
    if isinstance(batch, dict):
        # keep the traced keyword order
        b_kwargs = {k: b_kwargs[k] for k in kwargs} | {k: v for k, v in b_kwargs.items() if k not in kwargs}
    return b_args, b_kwargs


# --- the solve loop ------------------------------------------------------------------------


def _units(ra):
    """Solve units: head families (outer perm class + classes fibred directly over it) and the
    remaining groups, in report order."""
    an = ra._analysis
    by_root = {g.root: g for g in ra.groups}
    fam: dict[int, list] = {}
    for g in ra.groups:
        fib = an.fibre.get(g.root, ())
        if len(fib) == 1:
            fam.setdefault(fib[0], []).append(g)
    units, done = [], set()
    for g in ra.groups:
        if g.id in done:
            continue
        if g.root in fam:
            units.append(("family", g, fam[g.root]))
            done |= {g.id} | {x.id for x in fam[g.root]}
    for outer, members in fam.items():
        if outer not in by_root and not any(m.id in done for m in members):
            units.append(("fixed-heads", None, members))
            done |= {m.id for m in members}
    for g in ra.groups:
        if g.id not in done:
            units.append(("single", g, []))
            done.add(g.id)
    units.sort(key=lambda u: (u[1] or u[2][0]).id)
    return units


def _element_from(result, kind, nA, nB):
    el = result.element
    if result.status == "soft" or nA != nB or (el.shape[-1] != el.shape[-2]):
        return Map.from_plan(el)
    return el


def align(model_a, model_b, inputs=None, *, data=None, solver=None, inner="procrustes",
          max_iter: int = 6, groups=None, rescale: bool = False, reg: float | None = None,
          report_a=None, report_b=None) -> Alignment:
    """Align ``model_b`` to ``model_a``'s basis.

    Parameters
    ----------
    inputs : example inputs (tuple / dict), default from the config (HF) or the first batch.
    data : iterable of batches in the same form as ``inputs``: similarity from activations.
        Without it, similarity from weights (data-free).
    solver : None (by group kind: Hungarian / Procrustes / RoPE / OT for different widths),
        "ot" (exact transport), "sinkhorn" (soft maps, ``reg``).
    inner : "procrustes" (seed 003) or "hungarian" (seed 002) inside heads.
    rescale : seed 003's rescaling: after the rotations, each ``gl`` class (per head) also
        takes the positive scalar that brings B's weights closest to A's (``alignment.scales``).
    groups : optional predicate ``group -> bool`` selecting which groups to align. Groups
        not selected keep B's order; when a head class is not selected but classes fibred
        over it are, heads are paired by index and each head's inner element is solved
        (seed 003's per-head Procrustes).
    """
    from . import analyze
    for m, label in ((model_a, "model_a"), (model_b, "model_b")):
        if not isinstance(m, torch.nn.Module):
            raise InputError(f"{label} must be a torch.nn.Module, got {type(m).__name__}")
        _check_finite(m, label)
    data = list(data) if data is not None else None
    if data is not None and len(data) == 0:
        raise InputError("data is empty; expected at least one batch")
    if inputs is None and data is not None:
        inputs = data[0]
    t0 = time.perf_counter()
    ra = report_a or analyze(model_a, inputs)
    rb = report_b or analyze(model_b, inputs if inputs is not None else None)
    t_an = time.perf_counter() - t0
    check_compatible(ra, rb)
    pairs = list(zip(ra.groups, rb.groups))
    sel = [groups(ga) if groups else True for ga, _ in pairs]
    b_of = {ga.id: gb for ga, gb in pairs}
    elements: dict = {}
    results: dict = {}
    solve_s = 0.0
    units = [u for u in _units(ra) if any(sel[g.id] for g in ([u[1]] if u[1] else []) + u[2])]
    feats = _WeightFeatures(ra, rb, model_a, model_b)
    versions = feats.versions  # B class root -> number of times its element changed

    def wsim(ga, cross, usable=None):
        return feats.similarity(ga, b_of[ga.id], elements, cross, usable)
    sweeps = max_iter
    if data is None:
        sim = wsim
    else:
        stats, _ = _activation_similarity(ra, rb, data,
                                          [(ga, b_of[ga.id]) for ga in ra.groups])
        # activations where a class is observed cleanly; weights (given the rest) elsewhere
        def sim(ga, cross, usable=None):
            m = _act_matrix(stats[ga.id], ga, cross)
            return (m, True, frozenset()) if m is not None else wsim(ga, cross, usable)
        if all(stats[g.id].n > 0 for g in ra.groups):
            sweeps = 1

    def roots(u):
        kind, outer, members = u
        gs = ([outer] if outer is not None and sel[outer.id] else []) + [m for m in members if sel[m.id]]
        return {b_of[g.id].root for g in gs}

    def set_element(g, el, res):
        nonlocal solve_s, changed
        r = b_of[g.id].root
        if isinstance(el, torch.Tensor) and el.dim() == 2 and _is_perm(el):
            el = Perm.from_matrix(el)  # n indices instead of an n×n matrix
            res.element = el
        if not _same(elements.get(r), el):
            versions[r] = versions.get(r, 0) + 1
            changed = True
        elements[r] = el
        results[g.id] = res
        solve_s += res.seconds

    last: dict = {}  # unit index -> (versions of the classes it used, complete)
    for sweep in range(sweeps):
        changed = False
        if sweep == 0:
            order = _schedule(units, roots, feats, b_of, sel)
        pending = set().union(*(roots(u) for u in units)) if sweep == 0 else set()
        for ui in order:
            kind, outer, members = units[ui]
            if sweep > 0 and ui in last:
                used, complete = last[ui]
                if complete and all(versions.get(r, 0) == v for r, v in used.items()):
                    continue  # nothing it depends on changed since it was solved
            # first sweep: only slots whose other axes are known (fixed or already solved)
            pending -= roots(units[ui])
            usable = (lambda dep: not (dep & pending)) if pending else None
            mem = [outer] if kind == "single" else [m for m in members if sel[m.id]]
            got = [sim(m, kind != "single", usable) for m in mem]
            if usable is not None and not any(x[0] is not None for x in got):
                # nothing clean: assume the rest in B's order for now
                got = [sim(m, kind != "single") for m in mem]
            used = set().union(*(x[2] for x in got))
            last[ui] = ({r: versions.get(r, 0) for r in used}, all(x[1] for x in got))
            keep = [(m, x[0]) for m, x in zip(mem, got) if x[0] is not None]
            if not keep:
                continue
            if kind == "single":
                ga, s = keep[0]
                res, el = _solve_single(ga, b_of[ga.id], s, solver, rescale, reg, ra, rb)
                set_element(ga, el, res)
            elif kind == "fixed-heads" or not sel[outer.id]:
                # heads kept in index order (no head class, or not selected): per-head inner
                for m, s in keep:
                    diag = torch.stack([s[h, h] for h in range(s.shape[0])])
                    res = S.inner_blocks(orthogonal_part(m.kind), diag, m.pairs, inner)
                    el = res.element
                    set_element(m, el if el.shape[-1] == el.shape[-2] else Map.from_plan(el), res)
            else:
                kinds = [orthogonal_part(m.kind) for m, _ in keep]
                out_res, inner_els = S.nested_heads(
                    [s for _, s in keep], kinds, [m.pairs for m, _ in keep], inner=inner,
                    outer="hungarian" if solver not in ("ot", "sinkhorn") else "ot")
                HA, HB = keep[0][1].shape[:2]
                match = out_res.element.argmax(0)
                set_element(outer, _element_from(out_res, "perm", HA, HB), out_res)
                for (m, s), el in zip(keep, inner_els):
                    nA, nB = s.shape[-2:]
                    obj = float((el * s[match, torch.arange(HB)]).sum())
                    set_element(m, el if nA == nB else Map.from_plan(el), S.SolveResult(el, obj))
        if not changed:
            break
    al = Alignment(ra, rb, elements, results, "weights" if data is None else "activations",
                   {"analyze": t_an, "solver": solve_s, "sweeps": sweep + 1})
    al._template = model_a
    if rescale:
        al.scales = _fit_scales(al, model_a, model_b, [g for g in ra.groups if sel[g.id]], b_of)
    al.seconds["total"] = time.perf_counter() - t0
    return al


def _fit_scales(al, model_a, model_b, groups, b_of):
    """Seed 003's rescaling: for each ``gl`` class, per block (head), the scalar ``a > 0``
    minimising ``Σ_co ‖A − a·B'‖² + Σ_contra ‖A − B'/a‖²`` over its slots, where ``B'`` is B
    in A's basis. ``a·E`` is still in GL (co slots scale by ``a``, contra by ``1/a``), so the
    model's function is unchanged. Updates ``al.elements``; returns ``{group id: [a, ...]}``."""
    from scipy.optimize import minimize_scalar
    ea, eb = al.report_a._analysis, al.report_b._analysis
    targets = [g for g in groups if g.kind == "gl" and b_of[g.id].root in al.elements
               and isinstance(al.elements[b_of[g.id].root], torch.Tensor)]
    if not targets:
        return {}
    Bp = al.state(model_b)
    out = {}
    for g in targets:
        gb = b_of[g.id]
        E = al.elements[gb.root]
        nblk = int(np.prod(E.shape[:-2])) if E.dim() > 2 else 1
        # E's blocks are indexed by B's heads; the views below by A's: B head of each A head
        fib = [al.elements.get(f) for f in eb.fibre.get(gb.root, ())]
        if any(not (f is None or isinstance(f, Perm)) for f in fib):
            continue  # heads matched by a soft/rectangular map: no per-head correspondence
        acc = torch.zeros(nblk, 4, dtype=torch.float64)  # co: Σb², Σab; contra: Σb², Σab
        for (name, d), var in zip(g.params, g.variance):
            ax = ea.node_axes[ea.param_nodes[name]]
            ta = model_a.get_parameter(name).detach().double()
            tb = Bp[name].double()
            for idx, nf in leaf_views(ea, ax[d], g.root):
                xa = _gather(ta, d, idx, nf).reshape(nblk, -1)
                xb = _gather(tb, d, idx, nf).reshape(nblk, -1)
                k = 0 if var == "co" else 2
                acc[:, k] += (xb * xb).sum(1)
                acc[:, k + 1] += (xa * xb).sum(1)
        acc = acc.reshape(*E.shape[:-2], 4)
        for j, f in enumerate(fib):
            if f is not None:
                acc = acc.index_copy(j, f.index, acc.clone())  # A head i -> B head index[i]
        scales = []
        for q, c, kk, dd in acc.reshape(nblk, 4).tolist():
            f = lambda t: q * np.exp(2 * t) - 2 * c * np.exp(t) + kk * np.exp(-2 * t) - 2 * dd * np.exp(-t)  # noqa: E731
            r = minimize_scalar(f, bounds=(-6.0, 6.0), method="bounded")
            scales.append(float(np.exp(r.x)) if f(r.x) < f(0.0) else 1.0)
        sc = torch.tensor(scales, dtype=torch.float64).reshape(*E.shape[:-2], 1, 1)
        al.elements[gb.root] = E * sc
        out[g.id] = scales
    return out


def _same(old, new):
    if old is None:
        return False
    if isinstance(old, Perm) or isinstance(new, Perm):
        return (isinstance(old, Perm) and isinstance(new, Perm)
                and torch.equal(old.index, new.index))
    a = old.co if isinstance(old, Map) else old
    b = new.co if isinstance(new, Map) else new
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=0, atol=1e-9))


def _schedule(units, roots, feats, b_of, sel):
    """Order the first sweep so that each unit is solved when as much of its weight (by
    parameter size) as possible has its other axes known: classes whose features sit on fixed
    axes (the residual stream through the embeddings) go first, then the ones that need them."""
    pending = set().union(*(roots(u) for u in units)) if units else set()
    left, order = list(range(len(units))), []
    slot_info = {}
    for i, (kind, outer, members) in enumerate(units):
        gs = [outer] if kind == "single" else [m for m in members if sel[m.id]]
        slot_info[i] = [(feats.deps(b_of[g.id], n, d), feats.B[n].numel())
                        for g in gs for n, d in feats.slots(g)]
    while left:
        def known(i):
            mine = roots(units[i])
            tot = sum(w for _, w in slot_info[i]) or 1
            return sum(w for dep, w in slot_info[i] if not (dep & (pending - mine))) / tot
        best = max(left, key=lambda i: (known(i), -i))
        order.append(best)
        left.remove(best)
        pending -= roots(units[best])
    return order


def _solve_single(ga, gb, s, solver, rescale, reg, ra, rb):
    kind = orthogonal_part(ga.kind)
    nA, nB = s.shape[-2:]
    if s.dim() == 3:  # fibred over a fixed class, solved per fibre entry
        res_list = [S.solve(kind, s[h], pairs=ga.pairs, solver=None if nA == nB else "ot") for h in range(s.shape[0])]
        el = torch.stack([r.element for r in res_list])
        res = S.SolveResult(el, sum(r.objective for r in res_list), seconds=sum(r.seconds for r in res_list))
        return res, el if nA == nB else Map.from_plan(el)
    use = solver if (solver in ("ot", "sinkhorn") and kind in ("perm", "signed_perm")) else None
    if kind not in ("perm", "signed_perm") and solver == "hungarian":
        use = None
    res = S.solve(kind, s, pairs=ga.pairs, solver=use, rescale=rescale, reg=reg)
    return res, _element_from(res, kind, nA, nB)


def _act_matrix(stats, g, cross):
    if stats.n == 0:
        return None
    kind = orthogonal_part(g.kind)
    m = stats.matrix(kind)  # [Fa, Fb, n, n]
    if kind in ("orthogonal", "rope") and m.shape[0] > 1:
        n = max(stats.n, 1)
        va = (stats.saa / n - (stats.sa / n) ** 2).sum(-1).clamp_min(1e-30).sqrt()
        vb = (stats.sbb / n - (stats.sb / n) ** 2).sum(-1).clamp_min(1e-30).sqrt()
        m = m / (va[:, None, None, None] * vb[None, :, None, None])
    if g.outer or m.shape[0] > 1:
        return m if cross else torch.stack([m[h, h] for h in range(m.shape[0])])
    return m[0, 0]

