"""Group elements and transport maps as values, and their action along one tensor dimension.

An element of a leaf class is a tensor ``[*fibre_sizes, n, n]`` (one ``n×n`` matrix per entry
of the outer head classes it is fibred over), a :class:`Perm` (an unfibred permutation kept as
indices), or a :class:`Map` (a possibly rectangular map between two models' coordinates).
"""
from __future__ import annotations

import torch

from .gemm import linear, matmul

__all__ = ["Perm", "Map", "Blocks", "is_perm", "inv_t", "apply_along", "mark_perm", "mark_orth", "elements_on"]


def mark_perm(P: torch.Tensor) -> torch.Tensor:
    """``P``, marked as a (batch of) permutation matrices: :func:`is_perm` skips its check."""
    setattr(P, "_symgraph_perm", True)  # a tensor takes Python attributes; torch's stub has no field for it
    return P


def mark_orth(R: torch.Tensor) -> torch.Tensor:
    """``R``, marked orthogonal: :func:`inv_t` returns it without an ``n³`` check."""
    setattr(R, "_symgraph_orth", True)
    return R


def inv_t(E):
    """``E^{-T}`` (no inversion for permutations and orthogonal matrices)."""
    if getattr(E, "_symgraph_orth", False) or is_perm(E):
        return E  # P^{-T} = P; a solver's rotation
    eye = torch.eye(E.shape[-1], dtype=E.dtype, device=E.device)
    if E.shape[-1] == E.shape[-2] and bool(((E @ E.mT) - eye).abs().max() <= 1e-12):
        return E  # orthogonal (Procrustes, RoPE): R^{-T} = R
    return torch.linalg.inv(E).mT


def is_perm(M):
    """A (batch of) permutation matrices: exactly one nonzero per row, rows and columns sum
    to 1 (so that nonzero is 1 and no column is hit twice). Three reductions, no copies."""
    if getattr(M, "_symgraph_perm", False):
        return True
    n = M.shape[-1]
    return (M.shape[-2] == n and int(M.count_nonzero()) == M.numel() // n
            and bool((M.sum(-1) == 1).all()) and bool((M.sum(-2) == 1).all()))


class Perm:
    """A permutation element kept as indices (``n`` integers instead of an ``n×n`` matrix):
    row ``i`` of the matrix has its 1 in column ``index[i]``. Used by :func:`symgraph.align`
    for unfibred permutation classes; :func:`axis_matrix` returns the index vector for them."""

    def __init__(self, index):
        self.index = torch.as_tensor(index, dtype=torch.long)

    @classmethod
    def from_matrix(cls, M):
        return cls(M.argmax(-1))

    @property
    def shape(self):
        n = len(self.index)
        return torch.Size((n, n))

    def to(self, device) -> "Perm":
        return Perm(self.index.to(device))

    def dense(self, dtype=torch.float64):
        n = len(self.index)
        M = torch.zeros(n, n, dtype=dtype, device=self.index.device)
        M[torch.arange(n, device=self.index.device), self.index] = 1
        M._symgraph_perm = True
        return M


class Map:
    """A (possibly rectangular) map between two models' coordinates of one class.

    ``co [*fibres, n_A, n_B]`` acts on covariant slots, ``contra`` on contravariant ones. For a
    group element ``g``: ``co = g``, ``contra = g^{-T}``. For a transport plan ``T``: ``co``
    averages B's units into each of A's (row-normalised T), ``contra`` sums their contributions
    (column-normalised T), so that a function-preserving widening is undone exactly.
    """

    def __init__(self, co, contra):
        self.co, self.contra = co, contra

    @classmethod
    def from_plan(cls, T):
        co = T / T.sum(-1, keepdim=True).clamp_min(1e-300)
        contra = T / T.sum(-2, keepdim=True).clamp_min(1e-300)
        return cls(co, contra)

    @property
    def shape(self):
        return self.co.shape

    def to(self, device) -> "Map":
        return Map(self.co.to(device), self.contra.to(device))


class Blocks:
    """A square map that moves whole blocks of ``b`` coordinates: block ``i`` of the result is
    ``blocks[i] @`` block ``index[i]`` of the input. The map of a head axis (a permutation of
    heads with a matrix per head) has this form; applied block by block it costs ``H·b²``
    per column instead of the dense ``(H·b)²``."""

    def __init__(self, index, blocks):
        self.index, self.blocks = index, blocks

    @classmethod
    def of(cls, M, sizes):
        """``M [n, n]`` as :class:`Blocks` for the first block size in ``sizes`` (each dividing
        ``n``) at which every block row and block column holds exactly one nonzero block; None
        when there is none. Exact: the blocks are ``M``'s own entries."""
        n = M.shape[-1]
        if M.dim() != 2 or M.shape[0] != n:
            return None
        for b in sizes:
            if not 0 < b < n or n % b:
                continue
            H = n // b
            nz = (M.reshape(H, b, H, b) != 0).any(3).any(1)  # [H, H]: which blocks are nonzero
            if bool((nz.sum(0) == 1).all()) and bool((nz.sum(1) == 1).all()):
                index = nz.to(M.dtype).argmax(1)
                rows = torch.arange(H, device=M.device)
                return cls(index, M.reshape(H, b, H, b)[rows, :, index, :])
        return None

    def numel(self) -> int:
        return self.blocks.numel() + self.index.numel()

    def dim(self) -> int:
        return 2

    @property
    def shape(self):
        n = self.blocks.shape[0] * self.blocks.shape[1]
        return torch.Size((n, n))

    def dense(self):
        H, b = self.blocks.shape[:2]
        M = torch.zeros(H, b, H, b, dtype=self.blocks.dtype, device=self.blocks.device)
        M[torch.arange(H, device=M.device), :, self.index] = self.blocks
        return M.reshape(H * b, H * b)


def elements_on(elements: dict, device) -> dict:
    """An alignment's ``elements`` (group id -> :class:`Perm`, :class:`Map` or matrix) with their
    tensors on ``device``."""
    return {k: e.to(device) if isinstance(e, (Perm, Map, torch.Tensor)) else e for k, e in elements.items()}


def apply_along(t: torch.Tensor, d: int, M) -> torch.Tensor:
    """``t`` with ``M`` applied along dim ``d``: ``t'[.., i, ..] = Σ_j M[i, j] t[.., j, ..]``.

    ``M`` may also be a 1-D index tensor: the permutation ``t'[.., i, ..] = t[.., M[i], ..]``,
    or :class:`Blocks`.
    """
    moved = t.movedim(d, 0)
    shape = moved.shape
    if isinstance(M, Blocks):
        H, b = M.blocks.shape[:2]
        x = moved.reshape(H, b, -1)[M.index.to(t.device)]
        return matmul(M.blocks.to(t.device, t.dtype), x).reshape(shape).movedim(0, d)
    if M.dim() == 1:
        return moved[M.to(t.device)].movedim(0, d)
    if not M.requires_grad and is_perm(M):
        return moved[M.argmax(1).to(t.device)].movedim(0, d)  # a permutation: gather, no matmul
    M = M.to(t.device, t.dtype)
    if d == t.dim() - 1:  # the last dim: one matmul, no transposed copy of t
        return linear(t, M)
    out = matmul(M, moved.reshape(shape[0], -1)).reshape(M.shape[0], *shape[1:])
    return out.movedim(0, d)
