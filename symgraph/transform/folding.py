"""Norm gains folded into their readers and back: the values side of ``passes/norms.py``.

A :class:`~symgraph.passes.patterns.norms.Fold` names a norm's gain ``g`` (and shift ``β``) and the
linear layers that read it. :func:`fold` moves them into the readers (``W ← W diag g``,
``b ← b + W β``, ``g ← 1``, ``β ← 0``), the form the analysis describes; :func:`unfold` moves
them back out with the gains and shifts of a *gauge* (the model's own, or the anchor's when
B is carried into A's basis: ``W ← W diag(1/g)``, ``b ← b − W β``). Both keep the function.
A shift the readers cannot take (one has no bias) stays on the stream as ``β / g``. A gain
read with an offset (Gemma's ``x · (1 + w)``: ``Fold.offset`` 1) is ``g = w + offset``: folded,
``w ← 1 − offset``; a gauge holds the parameters ``w``.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from ..errors import InputError

__all__ = ["fold", "unfold", "gauge", "members", "groups", "for_reader"]


def _along(v, axis, ndim):
    shape = [1] * ndim
    shape[axis] = -1
    return v.reshape(shape)


def fold(folds, tensors: dict, dtype=torch.float64) -> dict:
    """Values (in ``dtype``) of the parameters ``folds`` change, with gains 1 and shifts 0."""
    out = {}
    for f in folds:
        if f.gain not in tensors:
            continue
        g = _gain(f, tensors[f.gain].to(dtype))
        beta = tensors[f.shift].to(dtype) if f.shift else None
        if f.keep_shift:
            _nonzero(f, g)
            out[f.shift], beta = beta / g, None
        for w, axis, b in f.readers:
            W = tensors[w].to(dtype)
            if beta is not None:
                out[b] = tensors[b].to(dtype) + torch.tensordot(W, beta, dims=([axis], [0]))
            out[w] = W * _along(g, axis, W.dim())
        out[f.gain] = torch.ones_like(g) - f.offset if f.offset else torch.ones_like(g)
        if beta is not None:
            out[f.shift] = torch.zeros_like(beta)
    return out


def unfold(folds, tensors: dict, gauge: dict, dtype=torch.float64) -> dict:
    """Values (in ``dtype``) that put the folded ``tensors`` back in the gains and shifts of
    ``gauge`` (``{name: tensor}`` holding every gain and shift of ``folds``)."""
    out = {}
    for f in folds:
        if f.gain not in tensors:
            continue
        kept = gauge[f.gain].to(dtype).to(tensors[f.gain].device)
        g = _gain(f, kept)
        _nonzero(f, g)
        beta = gauge[f.shift].to(dtype).to(g.device) if f.shift else None
        if f.keep_shift:
            out[f.shift], beta = tensors[f.shift].to(dtype) * g, None
        for w, axis, b in f.readers:
            W = tensors[w].to(dtype) / _along(g, axis, tensors[w].dim())
            if beta is not None:
                out[b] = tensors[b].to(dtype) - torch.tensordot(W, beta, dims=([axis], [0]))
            out[w] = W
        out[f.gain] = kept.clone()
        if beta is not None:
            out[f.shift] = beta.clone()
    return out


def _gain(f, w):
    """The gain ``f``'s norm reads from its parameter's value ``w``: ``w + f.offset``."""
    return w + f.offset if f.offset else w


def _nonzero(f, g):
    if bool((g == 0).any()):
        raise InputError(f"norm gain {f.gain!r} has zero entries: its fold cannot be undone; "
                         "analyse and align with fold_norms=False (--no-fold-norms)")


def gauge(folds, tensors: dict) -> dict:
    """The gains and shifts of ``tensors`` (detached), to unfold another model into."""
    names = [n for f in folds for n in (f.gain, f.shift) if n]
    return {n: tensors[n].detach() for n in names if n in tensors}


def members(f) -> tuple:
    """Every parameter a fold reads or writes (gain, shift, the readers' weights and biases):
    the tensors that must be folded, moved and unfolded together."""
    names = [f.gain, f.shift] + [n for w, _, b in f.readers for n in (w, b)]
    return tuple(dict.fromkeys(n for n in names if n))


def for_reader(f, name):
    """Fold ``f`` restricted to the reader whose weight or bias is ``name`` (all readers when
    ``name`` is None): a fold acts on each reader on its own, so a tensor can be folded, moved
    and unfolded with its gain, shift and bias alone."""
    return replace(f, readers=tuple(r for r in f.readers if name is None or name in (r[0], r[2])))


def groups(folds) -> dict:
    """``{parameter: members(fold)}`` for every parameter a fold touches (others: absent)."""
    return {n: members(f) for f in folds for n in members(f)}
