"""One symmetry group of a report (:class:`Group`) and one element per group (:class:`Transform`)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.elements import Perm
from ..core.groups import GroupKind

__all__ = ["Group", "Transform"]


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
    report: Any  # the SymmetryReport the groups are of (not imported: it imports this module)
    elements: dict

    def element(self, group: Group) -> torch.Tensor:
        """The element of ``group`` as a dense ``[*fibre_sizes, n, n]`` float64 tensor."""
        E = self.elements[group.id]
        return E.dense() if isinstance(E, Perm) else E
