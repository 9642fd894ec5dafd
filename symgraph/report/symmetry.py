"""The symmetry report: groups, frozen ops, elements, certificates. The axis queries that
alignment, transforms and merging read are its base, :class:`~symgraph.report.queries.AxisQueries`.
Classes are named by group id everywhere outside.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import torch

from ..core.elements import Perm
from ..core.groups import GroupKind, orthogonal_part, sample
from ..passes.axes import input_rows, leaves_with_parity, stored_slots

__all__ = ['SymmetryReport', 'Group', 'Transform', 'FLOAT32_TOL']

from .certify import FLOAT32_TOL  # noqa: E402 - re-exported
from .queries import AxisQueries  # noqa: E402


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




class SymmetryReport(AxisQueries):
    """What ``symgraph.analyze`` found: every weight-space symmetry the graph admits.

    Its own members are the user's report: the groups, where they act (:meth:`group_of`,
    :meth:`by_module`), their degrees of freedom, random elements (:meth:`random_transform`),
    the certificate, and the report written out (summary, JSON, networkx, DOT). The axis
    queries alignment, transforms and merging read (:meth:`param_axes`, :meth:`axis_map`,
    :meth:`observation_points`, ...) are inherited from
    :class:`~symgraph.report.queries.AxisQueries`: an internal interface between the stages,
    which may change between versions."""

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
