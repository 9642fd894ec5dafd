"""The products of weight matching's slots: gathering a slot's views, the cross products of
A's and B's features, and the slice-by-slice product of large slots in the exact dtype."""
from __future__ import annotations

import string

import torch

from ..core.gemm import einsum, linear

__all__ = ["gather", "cross", "sliced", "cross_by_columns", "HALF"]

HALF = (torch.bfloat16, torch.float16)
_LATE_BYTES = 64 << 20  # a slot over this in the exact dtype is converted a slice of columns at a time


def sliced(ta, tb, dtype, va, others) -> bool:
    """Whether a slot is converted to the exact ``dtype`` a slice at a time (in
    :func:`cross_by_columns`) rather than whole: over :data:`_LATE_BYTES` there, with no
    fibres and no other leaf's element to apply (nothing to compute in ``dtype`` before the
    product; the caller checks the maps on the other axes). A 1.1B model's token embeddings
    or LM head against the residual stream: 0.5 GB of float32 copies, else."""
    item = torch.empty((), dtype=dtype).element_size()
    return ((ta.numel() + tb.numel()) * item > _LATE_BYTES and all(fa == 0 for _, fa in va)
            and all(o == [] for o in others))


def cross_by_columns(xa, xb, dtype):
    """``xa @ xb.mT`` (``[n, m]``, ``[k, m]``) in ``dtype``, each input converted a slice of
    columns at a time (about :data:`_LATE_BYTES` for both) and the partial products summed."""
    item = torch.empty((), dtype=dtype).element_size()
    step = max(1, _LATE_BYTES // (item * max(xa.shape[0] + xb.shape[0], 1)))
    out = None
    for i in range(0, xa.shape[-1], step):
        part = linear(xa[:, i:i + step].to(dtype), xb[:, i:i + step].to(dtype))
        out = part if out is None else out.add_(part)
    return out


def gather(t, d, idx, nf, others=None):
    """Gather ``t``'s dim ``d`` by ``idx [*F, n, *O]`` → ``[*F, n, m]``; ``others`` holds the
    current elements of the O leaves (applied first, so B's O coordinates are in A's order).

    A fibred element's fibres index B's coordinates of the classes it is fibred over (as
    :meth:`~symgraph.alignment.result.Alignment.apply` reads them), so a leaf fibred over
    another O leaf is applied before that leaf moves its dim into A's order. (In the other
    order a value head permutation fibred over key heads, Qwen3-Next's linear attention, met
    its key heads already moved: the value dims came back wrong whenever the fibres'
    permutations differed.)"""
    moved = t.movedim(d, 0)
    flat = idx.reshape(-1)
    if nf == 0 and idx.dim() == 1 and len(flat) == moved.shape[0] and bool(
            (flat == torch.arange(len(flat), device=flat.device)).all()):
        x = moved  # the whole axis in order: a view, no copy (embeddings)
    else:
        x = moved[flat.to(moved.device)].reshape(*idx.shape, *moved.shape[1:])
    for pos, E, fpos in _inner_first(others or [], nf):
        x = _apply_leaf(x, nf + 1 + pos, E, fpos)
    lead = idx.shape[: nf + 1]
    return x.reshape(*lead, -1)


def _inner_first(others, nf) -> list:
    """``others`` ordered so that a leaf comes after every leaf fibred over it (leaf ``pos`` is
    dim ``nf + 1 + pos``; an element's fibre dims ``fpos``)."""
    left, out = list(others), []
    while left:
        free = next(o for o in left if not any(nf + 1 + o[0] in r[2] for r in left if r is not o))
        out.append(free)
        left.remove(free)
    return out


def _apply_leaf(x, pos, E, fpos):
    """Apply ``E [*fibres, a, b]`` along dim ``pos`` of ``x``; fibres index dims ``fpos``."""
    L = string.ascii_letters
    xs = [L[i] for i in range(x.dim())]
    new = L[x.dim()]
    es = "".join(xs[p] for p in fpos) + new + xs[pos]
    out = [new if i == pos else c for i, c in enumerate(xs)]
    return einsum(f"{es},{''.join(xs)}->{''.join(out)}", E.to(x.device, x.dtype), x)


def cross(xa, xb, nf, cross_fibres):
    if nf == 0:
        return linear(xa, xb)
    fa = xa.reshape(-1, *xa.shape[nf:])  # flatten fibres into one index
    fb = xb.reshape(-1, *xb.shape[nf:])
    if cross_fibres:
        return einsum("aim,bjm->abij", fa, fb)
    return einsum("aim,ajm->aij", fa, fb)
