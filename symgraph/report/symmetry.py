"""The symmetry report: groups, frozen ops, elements, certificates; and the one documented
view of the analysis (parameters, axes, the groups on an axis, observation points) that
alignment, transforms and merging read. Classes are named by group id everywhere outside.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch

from ..transform import folding
from ..core.elements import Blocks, Perm, is_perm
from ..core.groups import GroupKind, orthogonal_part, sample
from ..passes.axes import attention_sites, axis_matrix, input_rows, axis_tree, resized_shapes, leaf_views, linear_layers, leaves_with_parity, observation_points, other_leaf_elements, stored_slots
from ..passes.patterns.stacked import unview_of, view_of

__all__ = ['SymmetryReport', 'Group', 'Transform', 'FLOAT32_TOL']

from .certify import FLOAT32_TOL  # noqa: E402 - re-exported


@dataclass
class Group:
    """One symmetry group of the model: a class of axes that transform together.

    ``kind``: where the class sits in the group lattice (a :data:`~symgraph.core.groups.GroupKind`:
    ``"perm"``, ``"orthogonal"``, ``"gl"``, ``"rope"``, ...). ``size`` is the number of coordinates it acts on (``blocks × dim``); ``blocks`` > 1 for a
    head-structured class whose element is chosen independently per head (``outer`` lists the
    head groups it is fibred over); ``params`` lists ``(param_name, dim)`` slots and
    ``variance`` whether each takes ``g`` ("co") or ``g^{-T}`` ("contra"). ``buffers`` lists
    ``(buffer_name, dim)`` of the buffers that move with the class (BatchNorm's running
    statistics): transforms, alignments and merges carry them, weight matching does not read them.
    ``why``: the rule that narrowed the class to its kind (None for ``gl``).
    """
    id: int
    kind: GroupKind
    size: int
    dim: int
    blocks: int
    module: str
    params: list
    variance: list
    outer: list = field(default_factory=list)
    pairs: tuple | None = None
    buffers: list = field(default_factory=list)
    why: str | None = None

    @property
    def dof(self) -> int:
        """Continuous degrees of freedom (0 for discrete groups)."""
        n = self.dim
        per = {"gl": n * n, "orthogonal": n * (n - 1) // 2, "rope": len(self.pairs or ()),
               "orthogonal_mean": (n - 1) * (n - 2) // 2,
               "scaled_perm": n}.get(self.kind, 0)
        return per * self.blocks

    def to_dict(self):
        return {"id": self.id, "kind": self.kind, "size": self.size, "dim": self.dim,
                "blocks": self.blocks, "module": self.module, "outer": self.outer,
                "params": [[p, d] for p, d in self.params], "variance": self.variance,
                "buffers": [[b, d] for b, d in self.buffers], "why": self.why, "dof": self.dof}


@dataclass
class Transform:
    """One group element per group: ``elements[group.id]`` is ``[*fibre_sizes, n, n]`` float64,
    or a :class:`~symgraph.core.elements.Perm` for an unfibred permutation."""
    report: "SymmetryReport"
    elements: dict

    def element(self, group: Group) -> torch.Tensor:
        """The element of ``group`` as a dense ``[*fibre_sizes, n, n]`` float64 tensor."""
        E = self.elements[group.id]
        return E.dense() if isinstance(E, Perm) else E


def _common_prefix(names):
    parts = [n.split(".")[:-1] for n in names]
    if not parts:
        return ""
    out = []
    for seg in zip(*parts):
        if all(s == seg[0] for s in seg):
            out.append(seg[0])
        else:
            break
    return ".".join(out)




class SymmetryReport:
    """What ``symgraph.analyze`` found: every weight-space symmetry the graph admits."""

    def __init__(self, analysis, model_name: str, inputs, outputs=None):
        self._analysis = analysis
        self.model_name = model_name
        self.outputs = outputs  # the outputs its symmetries keep (None: all)
        self._inputs = inputs
        self.groups: list[Group] = []
        self.frozen = analysis.frozen
        self._nodes: list | None = None
        self._build()

    def _build(self):
        an = self._analysis
        uf = an.uf
        slots = stored_slots(an, an.param_nodes)
        roots = [r for r in slots if an.kind(r) != "identity" and uf.size[r] > 1]
        # order groups by first appearance among parameters (model order)
        order = {}
        for i, (name, node) in enumerate(an.param_nodes.items()):
            for a in an.node_axes[node]:
                for leaf, _ in leaves_with_parity(an, a, 0):
                    order.setdefault(leaf, i)
        roots.sort(key=lambda r: (order.get(r, 0), r))
        ids = {r: i for i, r in enumerate(roots)}
        bslots = stored_slots(an, an.buffer_nodes)  # buffers no group acts on keep their values
        for r in roots:
            fib = an.fibre.get(r, ())
            blocks = math.prod(uf.size[f] for f in fib) if fib else 1
            names = sorted({s[0] for s in slots[r]})
            self.groups.append(Group(
                id=ids[r], kind=an.kind(r), size=uf.size[r] * blocks, dim=uf.size[r],
                blocks=blocks, module=_common_prefix(names),
                params=[(s[0], s[1]) for s in slots[r]], variance=[s[2] for s in slots[r]],
                outer=[ids[f] for f in fib if f in ids], pairs=uf.pairs.get(r),
                buffers=[(s[0], s[1]) for s in bslots.get(r, [])],
                why=next((w for k, w in reversed(uf.reasons.get(r, [])) if k == an.kind(r)), None)))
        moved = {b for g in self.groups for b, _ in g.buffers}
        self._buffers = [n for n in an.buffer_nodes if n in moved]
        self._gid = ids  # union-find root -> group id (private: roots never leave this file)
        self._root = {i: r for r, i in ids.items()}

    # --- queries -------------------------------------------------------------------------
    def by_module(self, prefix: str):
        return [g for g in self.groups if g.module.startswith(prefix)]

    def group_of(self, param: str, dim: int):
        """Groups acting on ``param``'s (stored) dimension ``dim``."""
        raw = self._analysis.raw_axes.get(param)
        if raw is None:
            return [g for g in self.groups if (param, dim) in g.params]
        ids = set(self.axis_groups(raw[dim]))
        return [g for g in self.groups if g.id in ids]

    @property
    def degrees_of_freedom(self) -> int:
        return sum(g.dof for g in self.groups)

    # --- group elements ------------------------------------------------------------------
    def random_transform(self, seed: int = 0, orthogonal: bool = False) -> Transform:
        """One random element of every group (``orthogonal=True``: from its orthogonal part).

        Unfibred permutations are :class:`~symgraph.core.elements.Perm` index vectors (an MLP class
        of 11008 units would be a 1 GB dense matrix); the same seed draws the same elements."""
        gen = torch.Generator().manual_seed(seed)
        elements: dict = {}
        for g in self.groups:
            kind = orthogonal_part(g.kind) if orthogonal else g.kind
            shape = self.fibre_shape(g.id)
            if kind == "perm" and not shape:
                elements[g.id] = Perm(torch.randperm(g.dim, generator=gen))
            else:
                elements[g.id] = sample(kind, g.dim, gen, batch=shape, pairs=g.pairs)
        return Transform(self, elements)

    def certify(self, model, inputs=None, trials: int = 3, tol: float = 1e-6) -> float:
        """Apply random elements of every group in float64; return the worst relative change
        (raises :class:`CertificationError` over ``tol``; see :func:`.certify.certify`)."""
        from .certify import certify
        return certify(self, model, inputs, trials, tol)

    # --- presentation --------------------------------------------------------------------
    def summary(self) -> str:
        """The groups as a table, then moved buffers, folds and frozen ops."""
        from .draw import summary
        return summary(self)

    def __repr__(self):
        return f"<SymmetryReport {self.model_name}: {len(self.groups)} groups>"

    def to_dict(self):
        return {"model": self.model_name, "groups": [g.to_dict() for g in self.groups],
                "frozen": [f.to_dict() for f in self.frozen],
                "buffers": self.buffers, "fixed_buffers": self.fixed_buffers,
                "folds": [f.to_dict() for f in self.folds],
                "stacked": {k: list(v) for k, v in self.stacked.items()},
                "degrees_of_freedom": self.degrees_of_freedom}

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), **({"indent": 2} | kw))

    def to_networkx(self):
        """The transport-map flow: groups as nodes, parameters as edges between them."""
        from .draw import to_networkx
        return to_networkx(self)

    def to_dot(self) -> str:
        from .draw import to_dot
        return to_dot(self)

    def save_graph(self, path: str) -> str:
        """Write the class graph to ``.dot``, ``.png`` or ``.svg`` (atomically)."""
        from .draw import save_graph
        return save_graph(self, path)

    # --- the view of the analysis that alignment, transforms and merging use --------------
    # Axes are opaque integer handles (``param_axes``); classes are named by group id; element
    # dicts are ``{group id: element}``. Nothing outside this file and ``passes/`` reads the
    # analysis itself.

    @property
    def parameters(self) -> list:
        """Parameter names in graph order (one name per tied tensor: see :attr:`aliases`)."""
        return list(self._analysis.param_nodes)

    @property
    def buffers(self) -> list:
        """Names of the buffers that some group moves (running statistics), in graph order;
        :meth:`param_axes` takes them too. Other buffers stay as they are."""
        return list(self._buffers)

    @property
    def fixed_buffers(self) -> dict:
        """``{name: why}`` of the buffers no rule relates (they fix the classes they meet)."""
        return dict(self._analysis.fixed_buffers)

    @property
    def folds(self) -> list:
        """Norms whose gains fold into their readers (:class:`~symgraph.passes.patterns.norms.Fold`):
        the groups describe the model with these folded; transforms fold first, unfold after."""
        return list(self._analysis.folds)

    def fold(self, tensors: dict, dtype=torch.float64) -> dict:
        """New values (in ``dtype``) of the parameters the folds change: gains 1, shifts 0."""
        return folding.fold(self._analysis.folds, tensors, dtype)

    def unfold(self, tensors: dict, gauge: dict, dtype=torch.float64) -> dict:
        """Folded ``tensors`` back into the gains and shifts of ``gauge`` (in ``dtype``)."""
        return folding.unfold(self._analysis.folds, tensors, gauge, dtype)

    @property
    def aliases(self) -> dict:
        """Tied parameters: ``{reported name: [other names of the same tensor]}``."""
        return {k: list(v) for k, v in self._analysis.aliases.items()}

    @property
    def inputs(self):
        """``(args, kwargs)`` the model was traced with."""
        return self._inputs

    @property
    def exported_program(self):
        return self._analysis.ep

    @property
    def stacked(self) -> dict:
        """Parameters stored with a class on one axis and a class fibred over it on another
        (experts × hidden units of stacked expert weights): ``{name: (outer dim, inner dim)}``.
        :meth:`param_axes`, ``Group.params`` and every element see them *viewed*, the two dims
        flattened into one (outer first): :meth:`view` and :meth:`unview` convert."""
        return dict(self._analysis.stacked)

    @property
    def shared(self) -> dict:
        """``{group id: why}``: classes that could have one element per member of a label class
        (each expert's hidden units) but keep one for all, because that is too large."""
        return {self._gid[r]: w for r, w in self._analysis.shared.items() if r in self._gid}

    def view(self, name: str, t):
        """Stored tensor ``t`` of parameter ``name`` in the layout of :meth:`param_axes`."""
        s = self._analysis.stacked.get(name)
        return t if s is None else view_of(t, *s)

    def unview(self, name: str, x):
        """Inverse of :meth:`view`: the stored layout of parameter ``name``."""
        s = self._analysis.stacked.get(name)
        if s is None:
            return x
        o, j = s
        return unview_of(x, o, j, self.param_shape(name))

    def param_shape(self, name: str) -> tuple:
        """The stored shape of parameter (or moved buffer) ``name``."""
        an = self._analysis
        node = an.param_nodes.get(name) or an.buffer_nodes[name]
        return tuple(int(x) for x in node.meta["val"].shape)

    def param_axes(self, name: str) -> tuple:
        """Axis handles of parameter (or moved buffer, :attr:`buffers`) ``name``'s dims."""
        an = self._analysis
        node = an.param_nodes.get(name)
        return tuple(an.node_axes[an.buffer_nodes[name] if node is None else node])

    def axis_size(self, axis) -> int:
        return self._analysis.uf.size[axis]

    def axis_key(self, axis):
        """A hashable key equal for axes that always carry the same map."""
        return self._analysis.uf.find(axis)

    def axis_groups(self, axis) -> list:
        """Ids of the groups among the leaf classes of ``axis`` (e.g. heads and head_dim)."""
        return [self._gid[r] for r in self._analysis.leaves(axis) if r in self._gid]

    def axis_fixed(self, axis) -> bool:
        """Whether ``axis`` is one fixed class with no structure (vocabulary, labels, ...)."""
        an = self._analysis
        r = an.uf.find(axis)[0]
        return an.kind(r) == "identity" and r not in an.uf.struct

    def axis_structure(self, axis):
        """``None`` for a leaf axis, else ``(kind, [part sizes])``: ``"prod"`` (flatten) or
        ``"sum"`` (concatenation)."""
        an = self._analysis
        s = an.uf.struct.get(an.uf.find(axis)[0])
        return None if s is None else (s[0], [an.uf.size[an.uf.find(p)[0]] for p, _ in s[1]])

    def axis_tree(self, axis, _t=None):
        """``axis`` down to its leaves: ``("leaf", size, group id or None)`` or ``(kind, [subtrees])``."""
        t = axis_tree(self._analysis, axis) if _t is None else _t
        return ("leaf", t[1], self._gid.get(t[2])) if t[0] == "leaf" else (t[0], [self.axis_tree(None, x) for x in t[1]])

    def resized_shapes(self, sizes: dict) -> dict:
        """``{node name: output shape}`` of the traced graph when groups ``sizes`` (``{group id: new
        per-block size}``) change size (a list of shapes for an op with a list output)."""
        return resized_shapes(self._analysis, {self._root[g]: n for g, n in sizes.items()})

    def _roots(self, elements: dict) -> dict:
        return {self._root[g]: e for g, e in elements.items()}

    def axis_map(self, axis, elements: dict, blocks: bool = False):
        """The matrix carrying ``axis``'s coordinates by ``elements`` (``{group id: element}``):
        ``[n_A, n_B]`` float64, or a 1-D index vector for an unfibred :class:`Perm`, or None
        for the identity. ``blocks``: the cheapest form to apply instead of a square matrix: the
        index vector of any permutation, a :class:`~symgraph.core.elements.Blocks` where the
        axis is a product (heads × head dims) and the map moves whole blocks
        (:func:`~symgraph.core.elements.apply_along` takes each)."""
        M = axis_matrix(self._analysis, axis, self._roots(elements))
        if not blocks or M is None or M.dim() != 2 or M.shape[0] != M.shape[1]:
            return M
        if is_perm(M):
            return M.argmax(1)
        st = self.axis_structure(axis)
        if st is not None and st[0] == "prod":
            M = Blocks.of(M, [math.prod(st[1][j:]) for j in range(len(st[1]) - 1, 0, -1)]) or M
        return M

    def leaf_views(self, axis, gid, with_parity: bool = False):
        """Index arrays ``[*fibre_sizes, n_group, *other_leaf_sizes]`` into ``axis``'s coordinates,
        one per occurrence of group ``gid``: ``[(idx, n_fibres), ...]`` (sorted by path, so that two
        models agree); ``with_parity`` adds each one's parity (1: the group acts by ``E⁻ᵀ``)."""
        return leaf_views(self._analysis, axis, self._root[gid], with_parity)

    def other_leaf_elements(self, axis, gid, elements):
        """Per view of :meth:`leaf_views`, its other leaves: ``[(position, element, fibre dims)]``
        of those with an element; None for a view where one of them has no element yet."""
        return other_leaf_elements(self._analysis, axis, self._root[gid], self._roots(elements))

    def head_families(self) -> list:
        """Classes fibred over exactly one class: ``[(outer group id or None, [member ids])]``;
        ``None`` when the heads are fixed (their class is not a group)."""
        an = self._analysis
        fam: dict = {}
        for g in self.groups:
            fib = an.fibre.get(self._root[g.id], ())
            if len(fib) == 1:
                fam.setdefault(fib[0], []).append(g.id)
        return [(self._gid.get(outer), members) for outer, members in fam.items()]

    def fibre_groups(self, gid) -> tuple:
        """Per class that group ``gid``'s element is fibred over (outer to inner, the leading
        dims of the element): its group id, or None for a fixed class."""
        an = self._analysis
        return tuple(self._gid.get(f) for f in an.fibre.get(self._root[gid], ()))

    def fibre_shape(self, gid) -> tuple:
        """Sizes of the classes (groups or fixed) that group ``gid``'s element is fibred over."""
        an = self._analysis
        return tuple(an.uf.size[f] for f in an.fibre.get(self._root[gid], ()))

    def nodes(self) -> list:
        """Every graph node as ``(name, op, target)``, in graph order."""
        if self._nodes is None:
            self._nodes = [(n.name, n.op, n.target) for n in self._analysis.graph.nodes]
        return self._nodes

    def activation_axes(self, node_name) -> tuple:
        """Axis handles of an op's output tensor."""
        an = self._analysis
        return tuple(an.node_axes[self._node_by_name()[node_name]])

    def _node_by_name(self):
        return {n.name: n for n in self._analysis.graph.nodes}

    def input_rows(self, batches) -> dict:
        """``{parameter: row indices}``: the rows of each token embedding (a parameter the
        graph indexes by an input as given) that ``batches`` read (``align(..., rows=...)``)."""
        return input_rows(self._analysis, batches)

    def observation_points(self, gid, limit: int = 24) -> list:
        """Where group ``gid``'s coordinates can be read from activations (ops whose rule is
        marked ``observe``): ``[(node position, node name, dim)]``."""
        an = self._analysis
        pos = {n: i for i, n in enumerate(an.graph.nodes)}
        return [(pos[node], node.name, k)
                for node, k in observation_points(an, self._root[gid], limit)]

    def linear_layers(self) -> list:
        """Linear maps on a parameter: ``[(weight name, input node name, input feature axis,
        layout)]`` with layout ``"out_in"`` (``linear``) or ``"in_out"`` (``addmm``)."""
        return linear_layers(self._analysis)

    def attention_groups(self) -> list:
        """Per attention op (``scaled_dot_product_attention``), the groups on its per-head
        sizes: ``[{"qk": gid or None, "vo": gid or None, "node": name}]`` — the query/key
        contraction and the value/output side (Theus et al. 2025's two circuits)."""
        out = []
        for node, q, v in attention_sites(self._analysis):
            qk, vo = (next(iter(self.axis_groups(a)), None) for a in (q, v))
            out.append({"qk": qk, "vo": vo, "node": node})
        return out
