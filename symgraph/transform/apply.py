"""Applying group elements to parameters: the one walk "(parameter, axis, element)".

Every caller that moves tensors by a set of elements — :func:`transform` (a group element of
one model), :meth:`symgraph.Alignment.state` (model B into A's basis) and merging's
statistics (Fishers move with the squared map) — goes through :func:`map_parameters`.
Buffers that a group moves (``report.buffers``: BatchNorm's running statistics) are walked like
parameters: :func:`stored_tensors` reads both, :func:`write_state` writes both.
"""
from __future__ import annotations

import copy
import torch

from ..core.elements import Blocks, apply_along
from ..core.finite import require_module
from ..core.modes import set_mode
from . import folding
from ..errors import InputError

__all__ = ["map_parameters", "move", "move_piece", "stored_tensors", "write_state", "transform", "check_model"]


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
        val, t = None, report.view(name, t)  # stacked experts: (experts × hidden) as one axis
        for d, axis in enumerate(report.param_axes(name)):
            M = report.axis_map(axis, elements, blocks=True)
            if M is None:
                continue
            if squared and isinstance(M, Blocks):
                M = Blocks(M.index, M.blocks * M.blocks)
            elif squared and M.dim() > 1:
                M = M * M
            base = t if val is None else val
            val = apply_along(base if base.dtype == dtype else base.to(dtype), d, M)
        if val is not None:
            out[name] = report.unview(name, val)
    return out


def _tensor(model, name, buffer):
    return model.get_buffer(name) if buffer else model.get_parameter(name)


def stored_tensors(report, model, check: bool = False) -> dict:
    """``{name: tensor}`` (detached) of ``model``'s parameters and moved buffers named by
    ``report``. ``check``: refuse missing, meta or mis-shaped tensors by name."""
    out = {}
    for buffer, names in ((False, report.parameters), (True, report.buffers)):
        what = "buffer" if buffer else "parameter"
        for name in names:
            try:
                t = _tensor(model, name, buffer)
            except AttributeError as e:
                raise InputError(f"model has no {what} {name!r} that its report names; "
                                 "use the model the report was computed from") from e
            if check:
                if t.is_meta:
                    raise InputError(f"{what} {name!r} is on the meta device: no weights to transform")
                want = report.param_shape(name)
                if tuple(t.shape) != want:
                    raise InputError(f"{what} {name!r} has shape {tuple(t.shape)}, the report expects {want}")
            out[name] = t.detach()
    return out


def check_model(report, model, label: str = "the model") -> None:
    """Refuse ``model`` (named ``label``) unless it is of the class ``report`` was computed from
    and holds no parameter the report does not name: a model of another architecture has another
    symmetry structure, even where its tensors' names and shapes agree (a Qwen3 beside a Llama:
    per-head query and key norms)."""
    name, want = type(model).__name__, getattr(report, "model_name", None)
    if want and name != want:
        raise InputError(f"{label} is a {name}, but the report was computed from a {want}; expected a model of the "
                         f"report's architecture (analyse the {name} itself)")
    known = set(report.parameters) | {o for others in report.aliases.values() for o in others}
    extra = [n for n, _ in model.named_parameters(remove_duplicate=False) if n not in known]
    if extra:
        raise InputError(f"{label} has parameters its report does not name ({extra[0]!r}"
                         + (f" and {len(extra) - 1} more" if len(extra) > 1 else "") + "); expected the model the "
                         "report was computed from, or one of its architecture and config")


def write_state(model, state: dict, buffers=()) -> None:
    """Copy ``state`` (``{name: tensor}``) into ``model``'s parameters, and into its buffers
    for the names in ``buffers``, each in the tensor's own dtype and device."""
    buffers = set(buffers)
    with torch.no_grad():
        for name, val in state.items():
            t = _tensor(model, name, name in buffers)
            t.copy_(val.to(device=t.device, dtype=t.dtype))


def move(report, elements: dict, tensors: dict, gauge: dict | None = None, dtype=torch.float64,
         cast: dict | None = None) -> dict:
    """:func:`map_parameters` for a model whose report folds norm gains: fold, map, unfold
    into ``gauge``'s gains (default: ``tensors``' own). Returns values of every tensor that
    changed, in ``dtype``.

    ``cast`` (``{name: dtype}``): compute piece by piece (each reader of a fold with its gain,
    shift and bias; every other tensor alone) and return each value in its ``cast`` dtype at
    once, so that only one piece is held in ``dtype`` at a time (all of a 7B model in float64
    is 54 GB). The values are the same: a fold acts on each reader on its own."""
    if cast is not None:
        out: dict = {}
        for got in _moved_pieces(report, elements, tensors, gauge, dtype, cast):
            out.update(got)
        return out
    if not report.folds:
        return map_parameters(report, elements, tensors, dtype=dtype)
    return _move_piece(report, elements, tensors, report.folds, gauge, dtype)


def _moved_pieces(report, elements, tensors, gauge, dtype, cast):
    """:func:`move`'s values piece by piece, each in its ``cast`` dtype (a fold's gain comes
    back with each of its readers, the same value each time)."""
    for fold, names in _pieces(report, tensors):
        sub = {k: tensors[k] for k in names}
        got = _move_piece(report, elements, sub, [fold] if fold else [], gauge, dtype)
        yield {k: v.to(cast.get(k, v.dtype)) for k, v in got.items()}


def move_piece(report, elements, tensors: dict, fold=None, gauge: dict | None = None, dtype=torch.float64) -> dict:
    """:func:`move` of one piece of a model: ``tensors`` holds the members of ``fold`` (one
    reader's part of a norm fold, :func:`~symgraph.transform.folding.for_reader`: the reader's
    weight and bias with the gain and shift), or, with ``fold`` None, tensors no fold touches.
    Each value is the one :func:`move` gives that tensor with the whole model (a fold acts on
    each reader on its own)."""
    return _move_piece(report, elements, tensors, [fold] if fold is not None else [], gauge, dtype)


def _move_piece(report, elements, tensors, folds, gauge, dtype) -> dict:
    if not folds:
        return map_parameters(report, elements, tensors, dtype=dtype)
    folded = {**tensors, **folding.fold(folds, tensors, dtype)}
    moved = map_parameters(report, elements, folded, dtype=dtype)
    folded.update(moved)
    back = folding.unfold(folds, folded, tensors if gauge is None else gauge, dtype)
    return {k: back.get(k, folded[k]) for k in set(moved) | set(back)}


def _pieces(report, tensors):
    """``(fold or None, names)``: each reader of a fold whose gain is in ``tensors`` as a fold
    of its own (with the gain, shift and the reader's bias), then every other tensor alone."""
    done = set()
    for f in report.folds:
        if f.gain not in tensors:
            continue
        for fr in [folding.for_reader(f, r[0]) for r in f.readers] or [f]:
            names = [n for n in folding.members(fr) if n in tensors]
            done.update(names)
            yield fr, names
    for k in tensors:
        if k not in done:
            yield None, [k]


def transform(model, t):
    """Return a copy of ``model`` moved by the group element ``t`` (a :class:`Transform`);
    ``model`` itself is never modified."""
    require_module(model, "transform's model")
    if not (hasattr(t, "report") and hasattr(t, "elements")):
        raise InputError(f"transform's t is a {type(t).__name__}; expected a Transform (such as "
                         "report.random_transform())")
    check_model(t.report, model, "transform's model")
    new = copy.deepcopy(model)
    tensors = stored_tensors(t.report, model, check=True)
    cast = {k: v.dtype for k, v in tensors.items()}
    for got in _moved_pieces(t.report, t.elements, tensors, None, torch.float64, cast):
        write_state(new, got, t.report.buffers)  # piece by piece: no second copy of the model
    flags = [(m, m.training) for m in new.modules()]
    set_mode(new, True)  # by which a module drops what it cached from the old parameters (LeViT's biases)
    for m, f in flags:
        m.training = f
    return new
