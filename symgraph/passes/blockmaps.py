"""The map of a head axis as blocks, without its dense ``n×n`` matrix.

:func:`~.axes.axis_matrix` composes a product axis' map (heads × head dims) by applying each
factor's element to the ``n×n`` identity (an einsum over ``n²`` entries per factor, in float64);
:meth:`~symgraph.report.symmetry.AxisQueries.axis_map` then finds in it the
:class:`~symgraph.core.elements.Blocks` (a permutation of heads with a matrix per head) or the
permutation it is. Weight matching asks for the map of every head axis each time one of its
classes changes, and the merge once per tensor: about 0.07 s a 2048-wide axis on 2 cores, most
of it filling and reshuffling 32 MB. :func:`block_map` follows the same factors in the same order
on the blocks alone (each block's coordinates and its matrix), for the axes whose outer factors
are permutations; the entries are the elements' own, as in the composed matrix.
"""
from __future__ import annotations

import itertools
import math

import torch

from ..core.elements import Blocks, Perm, is_perm
from .axes import application_order, flat_factors, gather_fibres, leaf_element

__all__ = ["block_map", "sum_index"]


def block_map(an, axis, elements: dict):
    """What ``axis_map(axis, elements, blocks=True)`` returns (the index vector when the map is
    a permutation, else :class:`Blocks` at the innermost factor's size), for a product axis
    whose factors are leaves, every factor but the innermost carrying a permutation (per fibre;
    signed or scaled: each block scaled) or nothing, and the innermost a square element (or
    nothing), fibred over outer factors of the axis only; for a direct sum of permuted parts,
    :func:`sum_index`. None for any other axis (the composed matrix decides those)."""
    uf = an.uf
    r, _ = uf.find(axis)
    s = uf.struct.get(r)
    if s is not None and s[0] == "sum":
        return sum_index(an, axis, elements)
    if s is None or s[0] != "prod":
        return None
    factors = flat_factors(an, axis, 0)
    fclasses = [uf.find(a)[0] for a, _ in factors]
    if any(c in uf.struct for c in fclasses) or len(set(fclasses)) != len(fclasses):
        return None
    sizes = [uf.size[c] for c in fclasses]
    m, b = len(factors) - 1, sizes[-1]
    if m < 1 or uf.size[uf.find(s[1][-1][0])[0]] != b:
        return None  # the innermost part is itself a product: its blocks are larger
    subs = []
    for k, (a, pa) in enumerate(factors):
        ra, pra = uf.find(a)
        E, f = leaf_element(an, ra, pra ^ pa, elements)
        if E is not None:
            E, f = gather_fibres(an, E, f, k, factors, fclasses)
            if any(x not in fclasses[:m] for x in f) or E.shape[-1] != E.shape[-2] or E.shape[-1] != sizes[k]:
                return None  # fibred over the innermost factor (heads last) or off the axis
            if k < m and not _monomial(E):
                return None
        subs.append((E, f))
    if all(E is None for E, _ in subs):
        return None  # the identity: axis_matrix says so at once
    dev = next(E.device for E, _ in subs if E is not None)
    H = math.prod(sizes[:m])
    coords, blocks, scale = _carry(subs, fclasses, sizes, m, dev)
    target = sum(coords[j] * math.prod(sizes[j + 1:m]) for j in range(m))
    index = torch.empty(H, dtype=torch.long, device=dev)
    index[target] = torch.arange(H, device=dev)  # output block -> the source block it reads
    if blocks is None and scale is None:  # the whole map is a permutation of blocks: its index vector
        return (index[:, None] * b + torch.arange(b, device=dev)).reshape(-1)
    if blocks is None:
        blocks = torch.eye(b, dtype=torch.float64, device=dev).expand(H, b, b)
    blocks = blocks[index] if scale is None else blocks[index] * scale[index, None, None]
    if is_perm(blocks):  # a permutation within each block too
        return (index[:, None] * b + blocks.argmax(-1)).reshape(-1)
    if not bool((blocks != 0).flatten(1).any(1).all()):
        return None  # a zero block: not a map of this form
    return Blocks(index, blocks)


def sum_index(an, axis, elements: dict):
    """The index vector of a direct sum's map (a fused projection's segments: SwiGLU's gate and
    up halves of one ``linear``) whose parts are unfibred classes, each permuted (a
    :class:`~symgraph.core.elements.Perm`) or left alone, or sums of such: each part's index
    vector shifted to the part's offset, in place of the ``n×n`` matrix (a projector's 36864
    rows are 10 GB dense in float64). None where a part is anything else, or where no part
    moves (the identity: the composed matrix says so at once)."""
    got = _sum_pieces(an, axis, elements)
    if got is None or not got[1]:
        return None
    return got[0]


def _sum_pieces(an, axis, elements: dict):
    """``(index, moved)`` of :func:`sum_index`, or None (sums walked, not recursed into)."""
    uf = an.uf

    def leaf(r, p):
        E = elements.get(r)
        if r in uf.struct or (E is not None and (not isinstance(E, Perm) or an.fibre.get(r, ()))):
            return None
        return (torch.arange(uf.size[r]) if E is None else E.index), E is not None

    def combine(r, p, kind, subs):
        if any(sub is None for sub in subs):
            return None
        at = itertools.accumulate([0] + uf.part_sizes(r)[:-1])
        pieces = [index + o for (index, _), o in zip(subs, at)]
        dev = next((x.device for x in pieces if x.device.type != "cpu"), pieces[0].device)
        return torch.cat([x.to(dev) for x in pieces]), any(m for _, m in subs)

    return uf.fold(axis, leaf, combine, expand=lambda kind: kind == "sum")


def _carry(subs, fclasses, sizes, m, dev):
    """``(coords, blocks, scale)``: where each block goes (its coordinate in each outer factor),
    the innermost factor's element per block (None: none), and the product of the nonzeros of
    the outer factors' scaled or signed permutations per block (None: all permutations), each
    indexed by the block's source position."""
    H = math.prod(sizes[:m])
    ar = torch.arange(H, device=dev)  # each block's coordinates in the outer factors, row-major
    coords = [(ar // math.prod(sizes[j + 1:m])) % sizes[j] for j in range(m)]  # replaced, never
    # written to: they index the elements (autograd keeps them when the elements are learned)
    blocks = scale = None
    for k in application_order(subs, fclasses):
        E, f = subs[k]
        if E is None:
            continue
        at = tuple(coords[fclasses.index(x)] for x in f)
        Eh = E[at] if at else E.expand(H, *E.shape[-2:])  # [H, n, n]: each block's element
        if k == m:
            blocks = Eh.to(torch.float64)  # applied to the identity: its own entries
            continue
        # the coordinate this factor sends each block's to: the row of the nonzero in its column
        col = Eh[ar, :, coords[k]]
        if is_perm(E):
            coords[k] = col.argmax(-1)
            continue
        new = col.abs().argmax(-1)
        s = col.gather(-1, new[:, None])[:, 0].to(torch.float64)
        scale, coords[k] = (s if scale is None else scale * s), new
    return coords, blocks, scale


def _monomial(E) -> bool:
    """One nonzero per row and per column (a permutation, signed or scaled): it moves whole
    blocks, scaling each."""
    nz = E != 0
    return bool((nz.sum(-1) == 1).all()) and bool((nz.sum(-2) == 1).all())
