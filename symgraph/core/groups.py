"""The group lattice of axis classes, and sampling of group elements.

Kinds, from largest to smallest::

    gl ⊃ orthogonal ⊃ signed_perm ⊃ perm ⊃ identity
    gl ⊃ scaled_perm ⊃ perm
    orthogonal ⊃ rope (2x2 rotations on fixed coordinate pairs)
    orthogonal ⊃ orthogonal_mean ⊃ perm (orthogonal maps fixing the all-ones vector: they
        keep every vector's mean, so they commute with LayerNorm's centring)

``meet`` is the intersection. Intersections that are not in the list are rounded *down*
to a listed subgroup (e.g. ``rope ∧ perm`` → identity), which is always sound.
"""
from __future__ import annotations

import math
from typing import Literal, get_args

import torch

__all__ = ['GroupKind', 'KINDS', 'PERMUTATION_FAMILY', 'meet', 'ones_basis', 'orthogonal_part', 'pair_rotations', 'sample']

#: The kind of a symmetry group (:attr:`symgraph.report.symmetry.Group.kind`): one of the
#: lattice above. Annotating with it lets mypy catch a misspelt kind where one is passed.
GroupKind = Literal["identity", "perm", "signed_perm", "scaled_perm", "rope", "orthogonal_mean",
                    "orthogonal", "gl"]
#: Every :data:`GroupKind`, smallest group first.
KINDS: tuple[GroupKind, ...] = get_args(GroupKind)

# For each kind, the set of kinds it contains (itself included).
_SUBGROUPS: dict[GroupKind, set[GroupKind]] = {
    "identity": {"identity"},
    "perm": {"perm", "identity"},
    "signed_perm": {"signed_perm", "perm", "identity"},
    "scaled_perm": {"scaled_perm", "perm", "identity"},
    "rope": {"rope", "identity"},
    "orthogonal_mean": {"orthogonal_mean", "perm", "identity"},
    "orthogonal": {"orthogonal", "orthogonal_mean", "signed_perm", "perm", "rope", "identity"},
    "gl": set(KINDS),
}
# Largest first, so the first common subgroup found is the meet.
_ORDER: tuple[GroupKind, ...] = ("gl", "orthogonal", "orthogonal_mean", "scaled_perm", "signed_perm", "rope", "perm", "identity")

PERMUTATION_FAMILY: tuple[GroupKind, ...] = ("perm", "signed_perm", "scaled_perm")


def meet(a: GroupKind, b: GroupKind) -> GroupKind:
    """Largest listed subgroup of both ``a`` and ``b``.

    >>> meet("gl", "perm"), meet("orthogonal", "scaled_perm"), meet("rope", "perm")
    ('perm', 'perm', 'identity')
    """
    common = _SUBGROUPS[a] & _SUBGROUPS[b]
    for k in _ORDER:
        if k in common:
            return k
    return "identity"  # pragma: no cover


def orthogonal_part(kind: GroupKind) -> GroupKind:
    """The part of ``kind`` that solvers and ``orthogonal=True`` sampling use."""
    part: dict[GroupKind, GroupKind] = {"gl": "orthogonal", "scaled_perm": "perm"}
    return part.get(kind, kind)


def _haar(n: int, gen: torch.Generator, batch=()) -> torch.Tensor:
    a = torch.randn(*batch, n, n, generator=gen, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    d = torch.diagonal(r, dim1=-2, dim2=-1).sign()
    d[d == 0] = 1
    return q * d.unsqueeze(-2)


def ones_basis(n: int, dtype=torch.float64, device=None) -> torch.Tensor:
    """An orthogonal ``H [n, n]`` whose first column is ``𝟙/√n`` (a Householder reflection):
    its other columns are an orthonormal basis of the vectors with mean 0."""
    v = torch.full((n,), -1.0 / math.sqrt(n), dtype=dtype, device=device)
    v[0] += 1.0
    nv = v.norm()
    H = torch.eye(n, dtype=dtype, device=device)
    if nv > 1e-12:
        v = v / nv
        H = H - 2.0 * torch.outer(v, v)
    return H


def _haar_mean(n: int, gen: torch.Generator, batch=()) -> torch.Tensor:
    """Haar-random orthogonal maps that fix 𝟙: ``H diag(1, R) Hᵀ`` with ``R ∈ O(n-1)``."""
    H = ones_basis(n)
    inner = torch.eye(n, dtype=torch.float64).expand(*batch, n, n).clone()
    if n > 1:
        inner[..., 1:, 1:] = _haar(n - 1, gen, batch)
    return H @ inner @ H.mT


def pair_rotations(base: torch.Tensor, pairs, c, s) -> torch.Tensor:
    """A copy of ``base [..., n, n]`` with the 2×2 rotation ``[[c, -s], [s, c]]`` on each
    coordinate pair ``(i, j)`` of ``pairs`` (``c``, ``s``: ``[..., len(pairs)]``); differentiable
    in ``c`` and ``s``."""
    i = torch.tensor([p[0] for p in pairs], dtype=torch.long).to(base.device)
    j = torch.tensor([p[1] for p in pairs], dtype=torch.long).to(base.device)
    R = base.detach().clone()
    R[..., i, i], R[..., i, j], R[..., j, i], R[..., j, j] = c, -s, s, c
    return R


def _perm_matrices(n: int, gen: torch.Generator, batch=()) -> torch.Tensor:
    count = int(math.prod(batch)) if batch else 1
    eye = torch.eye(n, dtype=torch.float64)
    mats = torch.stack([eye[torch.randperm(n, generator=gen)] for _ in range(count)])
    return mats.reshape(*batch, n, n)


def sample(kind: GroupKind, n: int, gen: torch.Generator, batch=(), pairs=None) -> torch.Tensor:
    """Draw ``prod(batch)`` independent elements of ``kind`` acting on ``R^n``.

    Returns a float64 tensor of shape ``batch + (n, n)``; element ``g`` acts on a vector ``x``
    of that axis as ``g @ x``.
    """
    batch = tuple(batch)
    if kind == "identity":
        return torch.eye(n, dtype=torch.float64).expand(*batch, n, n).clone()
    if kind == "perm":
        return _perm_matrices(n, gen, batch)
    if kind == "signed_perm":
        signs = torch.randint(0, 2, (*batch, n, 1), generator=gen).double() * 2 - 1
        return signs * _perm_matrices(n, gen, batch)
    if kind == "scaled_perm":
        scales = torch.exp(0.3 * torch.randn(*batch, n, 1, generator=gen, dtype=torch.float64))
        return scales * _perm_matrices(n, gen, batch)
    if kind == "orthogonal":
        return _haar(n, gen, batch)
    if kind == "orthogonal_mean":
        return _haar_mean(n, gen, batch)
    if kind == "gl":
        s = torch.exp(torch.rand(*batch, 1, n, generator=gen, dtype=torch.float64) - 0.5)
        return (_haar(n, gen, batch) * s) @ _haar(n, gen, batch)
    if kind == "rope":
        if pairs is None:
            raise ValueError("rope sampling needs the coordinate pairs")
        g = torch.eye(n, dtype=torch.float64).expand(*batch, n, n)
        theta = 2 * math.pi * torch.rand(*batch, len(pairs), generator=gen, dtype=torch.float64)
        return pair_rotations(g, pairs, torch.cos(theta), torch.sin(theta))
    raise ValueError(f"unknown group kind {kind!r}; expected one of {KINDS}")
