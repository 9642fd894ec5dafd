"""Applying group elements to parameters: the one walk "(parameter, axis, element)".

Every caller that moves tensors by a set of elements — :func:`transform` (a group element of
one model), :meth:`symgraph.Alignment.state` (model B into A's basis) and merging's
statistics (Fishers move with the squared map) — goes through :func:`map_parameters`.
"""
from __future__ import annotations

import copy

import torch

from .elements import apply_along
from .errors import InputError

__all__ = ["map_parameters", "move", "transformed_state", "transform"]


def map_parameters(report, elements: dict, tensors: dict, *, squared: bool = False,
                   dtype=torch.float64) -> dict:
    """``tensors`` (``{parameter name: tensor}`` in the model of ``report``) with each class
    element of ``elements`` (``{group id: element}``) applied along every axis it acts on.

    Returns ``{name: tensor}`` for the tensors some element moved, in ``dtype`` (float64 by
    default; a tensor no element touches is left out). ``squared``: apply ``M ⊙ M`` instead of ``M`` (diagonal
    second moments, e.g. Fishers).
    """
    out = {}
    for name, t in tensors.items():
        val = None
        for d, axis in enumerate(report.param_axes(name)):
            M = report.axis_map(axis, elements)
            if M is None:
                continue
            if squared and M.dim() > 1:
                M = M * M
            base = t if val is None else val
            val = apply_along(base if base.dtype == dtype else base.to(dtype), d, M)
        if val is not None:
            out[name] = val
    return out


def transformed_state(report, transform, model) -> dict:
    """New values of every parameter the transform moves: ``{fqn: tensor}`` in its dtype."""
    tensors = {}
    for name in report.parameters:
        try:
            p = model.get_parameter(name)
        except AttributeError as e:
            raise InputError(f"model has no parameter {name!r} that its report names; "
                             "transform the model the report was computed from") from e
        if p.is_meta:
            raise InputError(f"parameter {name!r} is on the meta device: no weights to transform")
        want = tuple(report.axis_size(a) for a in report.param_axes(name))
        if tuple(p.shape) != want:
            raise InputError(f"parameter {name!r} has shape {tuple(p.shape)}, the report expects {want}")
        tensors[name] = p.detach()
    return {k: v.to(tensors[k].dtype) for k, v in move(report, transform.elements, tensors).items()}


def move(report, elements: dict, tensors: dict, gauge: dict | None = None, dtype=torch.float64) -> dict:
    """:func:`map_parameters` for a model whose report folds norm gains: fold, map, unfold
    into ``gauge``'s gains (default: ``tensors``' own). Returns values of every tensor that
    changed, in ``dtype``."""
    if not report.folds:
        return map_parameters(report, elements, tensors, dtype=dtype)
    folded = {**tensors, **report.fold(tensors, dtype)}
    moved = map_parameters(report, elements, folded, dtype=dtype)
    folded.update(moved)
    back = report.unfold(folded, tensors if gauge is None else gauge, dtype)
    return {k: back.get(k, folded[k]) for k in set(moved) | set(back)}


def transform(model, t):
    """Return a copy of ``model`` moved by the group element ``t`` (a :class:`Transform`);
    ``model`` itself is never modified."""
    new = copy.deepcopy(model)
    state = transformed_state(t.report, t, model)
    with torch.no_grad():
        for name, val in state.items():
            new.get_parameter(name).copy_(val)
    return new
