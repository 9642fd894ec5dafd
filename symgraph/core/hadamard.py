"""Hadamard matrices and the incoherent orthogonal elements built from them (QuaRot, Ashkboos
et al. 2024: a randomized Hadamard spreads an outlier channel over every coordinate).

:func:`hadamard` returns a normalised Hadamard matrix (first row and column all ones) of order
``n`` where one is known here: Sylvester's ``2^k``, Paley's construction I (``q + 1`` for a
prime ``q ≡ 3 mod 4``: 12, 20, 24, 32, 44, 48, 60, 68, 72, 80, 84, ...) and their Kronecker
products (``12 · 2^k``: 768, 1536, 3072; ``20 · 2^k``: 5120; ...); None otherwise.
:func:`incoherent` turns one into a random element of a group kind: ``H diag(±1) / √n`` for
``"orthogonal"``, ``H diag(1, ±1, ...) Hᵀ / n`` for ``"orthogonal_mean"`` (it fixes the all-ones
vector, so it commutes with LayerNorm's centring); a Haar-random element of the kind where no
Hadamard matrix of that order is known.
"""
from __future__ import annotations

import functools
import math

import torch

from .groups import GroupKind, sample

__all__ = ["hadamard", "incoherent", "KINDS"]

#: The group kinds :func:`incoherent` draws from (``"gl"`` is drawn from its orthogonal part).
KINDS = ("orthogonal", "orthogonal_mean", "gl")


def _is_prime(q: int) -> bool:
    return q > 1 and all(q % p for p in range(2, math.isqrt(q) + 1))


def _paley(q: int) -> torch.Tensor:
    """Paley's construction I: a Hadamard matrix of order ``q + 1`` (``q`` prime, ``≡ 3 mod 4``)."""
    residues = {(i * i) % q for i in range(1, q)}
    chi = torch.tensor([0.0] + [1.0 if i in residues else -1.0 for i in range(1, q)], dtype=torch.float64)
    idx = (torch.arange(q).unsqueeze(1) - torch.arange(q).unsqueeze(0)) % q
    Q = chi[idx]  # Jacobsthal matrix: skew-symmetric for q ≡ 3 mod 4
    S = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    S[0, 1:] = 1.0
    S[1:, 0] = -1.0
    S[1:, 1:] = Q
    return S + torch.eye(q + 1, dtype=torch.float64)


def _normalised(H: torch.Tensor) -> torch.Tensor:
    """``H`` with rows and columns signed so that its first row and first column are all ones."""
    H = H * H[:, :1]
    return H * H[:1, :]


@functools.lru_cache(maxsize=32)
def _cached(n: int):
    if n < 1:
        return None
    k = (n & -n).bit_length() - 1  # n = 2^k · m, m odd
    m = n >> k
    for j in range(k + 1):  # n = 2^(k-j) · (q + 1) with q + 1 = m · 2^j
        base = m << j
        if base == 1:
            H = torch.ones(1, 1, dtype=torch.float64)
        elif base % 4 == 0 and _is_prime(base - 1) and (base - 1) % 4 == 3:
            H = _paley(base - 1)
        elif base == 2:
            H = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        else:
            continue
        two = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        for _ in range(k - j):
            H = torch.kron(two, H)
        return _normalised(H)
    return None


def hadamard(n: int):
    """A normalised Hadamard matrix of order ``n`` (float64, entries ±1, ``H Hᵀ = n I``, first
    row and column all ones), or None where none is known here (see the module docstring)."""
    H = _cached(int(n))
    return None if H is None else H.clone()


def incoherent(kind: GroupKind, n: int, gen: torch.Generator, batch=(), how: str = "hadamard") -> torch.Tensor:
    """``prod(batch)`` elements ``[*batch, n, n]`` (float64) of group ``kind`` acting on ``R^n``,
    each with its own random signs: a randomized Hadamard matrix where ``how`` is
    ``"hadamard"`` and one of order ``n`` is known, else (or for ``how="random"``) Haar-random
    in the orthogonal part of ``kind``."""
    if kind not in KINDS:
        raise ValueError(f"no rotation in a group of kind {kind!r}; expected one of {KINDS}")
    kind = "orthogonal" if kind == "gl" else kind
    batch = tuple(batch)
    H = hadamard(n) if how == "hadamard" else None
    if H is None:
        return sample(kind, n, gen, batch=batch)
    signs = torch.randint(0, 2, (*batch, 1, n), generator=gen).double() * 2 - 1
    if kind == "orthogonal":
        return (H * signs) / math.sqrt(n)
    signs[..., 0] = 1.0  # H diag(s) Hᵀ / n fixes 𝟙 iff s_0 = 1 (Hᵀ𝟙 = n e_0, H e_0 = 𝟙)
    return (H * signs) @ H.T / n
