"""The symmetry report: groups, frozen ops, elements, certificates. The axis queries that
alignment, transforms and merging read are its base, :class:`AxisQueries` (the one documented
view of the analysis outside ``passes/``; internal, it may change between versions).
Classes are named by group id everywhere outside.
"""
from __future__ import annotations

import functools
import json
import math
from typing import Any

import torch

from ..transform import folding
from ..core.elements import Blocks, Perm, is_perm
from ..core.groups import orthogonal_part, sample
from ..passes.blockmaps import block_map
from ..passes.rows import input_rows, output_rows
from ..passes.axes import (attention_sites, axis_matrix, axis_tree, leaf_views, leaves_with_parity,
                           linear_layers, observation_points, other_leaf_elements, other_leaves, resized_shapes,
                           stored_slots)
from ..passes.patterns.stacked import unview_of, view_of
from ..passes.why import axis_reasons

__all__ = ['SymmetryReport', 'AxisQueries', 'Group', 'Transform', 'FLOAT32_TOL']

from .certify import FLOAT32_TOL  # noqa: E402 - re-exported
from .group import Group, Transform  # noqa: E402 - re-exported


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




class AxisQueries:
    """The axis queries of a report (a base of :class:`~symgraph.report.symmetry.SymmetryReport`,
    which sets ``_analysis``, ``_gid``, ``_root``, ``_buffers`` and ``groups``)."""

    _analysis: Any  # the passes' Analysis (read here and in passes/ only)
    _gid: dict  # union-find root -> group id
    _root: dict  # group id -> union-find root
    _buffers: list
    _nodes: list | None
    groups: list

    # --- the view of the analysis that alignment, transforms and merging use --------------
    # Axes are opaque integer handles (``param_axes``); classes are named by group id; element
    # dicts are ``{group id: element}``. Nothing outside this file and ``passes/`` reads the
    # analysis itself.

    @property
    def fixed_buffers(self) -> dict:
        """``{name: why}`` of the buffers no rule relates (they fix the classes they meet)."""
        return dict(self._analysis.fixed_buffers)

    @property
    def unsaved(self) -> dict:
        """``{name: why}`` of the parameters and buffers no checkpoint of the model stores (fixed:
        :func:`symgraph.passes.nodes.unsaved_tensors`)."""
        return dict(self._analysis.unsaved)

    @property
    def folds(self) -> list:
        """Norms whose gains fold into their readers (:class:`~symgraph.passes.patterns.norms.Fold`):
        the groups describe the model with these folded; transforms fold first, unfold after."""
        return list(self._analysis.folds)

    @functools.cached_property
    def fold_groups(self) -> dict:
        """``{parameter: the tensors folded, moved and unfolded with it}`` for every parameter a
        fold touches (:func:`~symgraph.transform.folding.groups`), computed once per report."""
        return folding.groups(self._analysis.folds)

    def fold(self, tensors: dict, dtype=torch.float64) -> dict:
        """New values (in ``dtype``) of the parameters the folds change: gains 1, shifts 0."""
        return folding.fold(self._analysis.folds, tensors, dtype)

    def unfold(self, tensors: dict, gauge: dict, dtype=torch.float64) -> dict:
        """Folded ``tensors`` back into the gains and shifts of ``gauge`` (in ``dtype``)."""
        return folding.unfold(self._analysis.folds, tensors, gauge, dtype)

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

    def axis_reasons(self, name: str, dim: int) -> list:
        """Why the classes on axis ``dim`` of parameter ``name`` (or of the output of the graph
        node ``name``) are what they are, per leaf class: ``{"size", "kind", "reasons",
        "fibre", "nofiber"}`` (:func:`symgraph.passes.why.axis_reasons`)."""
        an = self._analysis
        stored = name in an.param_nodes or name in an.buffer_nodes
        return axis_reasons(an, (self.param_axes(name) if stored else self.activation_axes(name))[dim])

    def axis_structure(self, axis):
        """``None`` for a leaf axis, else ``(kind, [part sizes])``: ``"prod"`` (flatten) or
        ``"sum"`` (concatenation)."""
        an = self._analysis
        r = an.uf.find(axis)[0]
        return (an.uf.struct[r][0], an.uf.part_sizes(r)) if r in an.uf.struct else None

    def axis_tree(self, axis):
        """``axis`` down to its leaves: ``("leaf", size, group id or None)`` or ``(kind, [subtrees])``."""
        return axis_tree(self._analysis, axis, self._gid.get)

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
        (:func:`~symgraph.core.elements.apply_along` takes each). An element carrying a gradient
        (learned matching's straight-through permutations) keeps the dense matrix: an index
        vector would drop its gradient."""
        roots = self._roots(elements)
        blocks = blocks and not (torch.is_grad_enabled() and any(
            isinstance(e, torch.Tensor) and e.requires_grad for e in roots.values()))
        fast = block_map(self._analysis, axis, roots) if blocks else None  # see passes.blockmaps
        return fast if fast is not None else self._composed_map(axis, roots, blocks)

    def _composed_map(self, axis, roots: dict, blocks: bool):
        """:meth:`axis_map` through the composed ``n×n`` matrix (:func:`axis_matrix`), its
        permutation or blocks found in it: every axis :func:`block_map` does not take."""
        M = axis_matrix(self._analysis, axis, roots)
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

    def other_leaf_groups(self, axis, gid) -> list:
        """Per view of :meth:`leaf_views`, the group ids of its other leaves (None: a fixed class)."""
        return [[self._gid.get(r) for r in o] for o in other_leaves(self._analysis, axis, self._root[gid])]

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


class SymmetryReport(AxisQueries):
    """What ``symgraph.analyze`` found: every weight-space symmetry the graph admits.

    Its own members are the user's report: the groups, where they act (:meth:`group_of`,
    :meth:`by_module`), their degrees of freedom, random elements (:meth:`random_transform`),
    the certificate, and the report written out (summary, JSON, networkx, DOT). The axis
    queries alignment, transforms and merging read (:meth:`param_axes`, :meth:`axis_map`,
    :meth:`observation_points`, ...) are inherited from
    :class:`AxisQueries`: an internal interface between the stages,
    which may change between versions."""

    def __init__(self, analysis, model_name: str, inputs, outputs=None):
        self._analysis = analysis
        self.model_name = model_name
        self.outputs = outputs  # the outputs its symmetries keep (None: all)
        self._inputs = inputs
        self.groups: list[Group] = []
        self.frozen = analysis.frozen
        # why every parameter stays fixed: one is never read by the traced inputs (None: none)
        self.unread = getattr(analysis, "unread_why", None)
        # unread parameters no method of their source reads: each stays fixed alone (name -> why)
        self.dead_parameters: dict = dict(getattr(analysis, "dead", {}))
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
        from ..core.schema import SEED
        gen = torch.Generator().manual_seed(SEED.check(seed, "seed="))
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
                "degrees_of_freedom": self.degrees_of_freedom,
                **({"unread": self.unread} if self.unread else {}),
                **({"dead_parameters": self.dead_parameters} if self.dead_parameters else {})}

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

    # --- what the model was traced with, and its parameters -----------------------------

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

    def input_rows(self, batches) -> dict:
        """``{parameter: row indices}``: the rows of each token embedding (a parameter the
        graph indexes by an input as given) that ``batches`` read (``align(..., rows=...)``)."""
        return input_rows(self._analysis, batches)

    def output_rows(self, ids) -> dict:
        """``{parameter: row indices}``: the rows ``ids`` of each parameter whose rows are a model
        output's channels (an untied language-model head: the tokens it predicts), for
        ``align(..., rows=...)`` beside :meth:`input_rows`, as Theus et al. 2025 match."""
        return output_rows(self._analysis, ids)
