"""Activation outliers put into a model without changing its function: what rotations for
quantization are for (issue 64's benchmark).

Trained LLMs carry a few input channels of their linear layers that are tens of times larger
than the rest, in the same dimensions across layers (Dettmers et al. 2022, LLM.int8();
Xiao et al. 2023, SmoothQuant). :func:`with_outliers` reproduces that in any model whose
report folds norm gains: for every fold, ``channels`` channels of the gain (and of the shift,
for LayerNorm) are multiplied by ``factor`` and the matching input columns of every reader of
that norm (the fold's readers, as the report names them) divided by it. The residual stream is
unchanged; the activations at the readers' inputs get ``factor``× outlier channels. The result
is certified like a rotation: its outputs equal the original's.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from ..errors import CertificationError, InputError
from ..transform.apply import stored_tensors, write_state
from .classes import certificate, rotation_report

__all__ = ["with_outliers", "Outliers"]


@dataclass
class Outliers:
    """What :func:`with_outliers` returns: the new ``model``, the ``channels`` scaled for each
    width (``{width: [index, ...]}``), the gains scaled (``norms``), whether the head was
    ``untied`` (as :func:`symgraph.rotate` unties it) and the certificate ``error``."""
    model: torch.nn.Module
    channels: dict
    norms: list
    untied: bool
    error: float


def _scaled(f, tensors: dict, idx, factor: float) -> dict:
    """Values (float64) of fold ``f``'s gain, shift and readers with channels ``idx`` scaled."""
    out = {}
    g = tensors[f.gain].to(torch.float64) + f.offset
    g[idx] *= factor
    out[f.gain] = g - f.offset
    if f.shift and f.shift in tensors:
        beta = tensors[f.shift].to(torch.float64).clone()
        beta[idx] *= factor
        out[f.shift] = beta
    for w, axis, _ in f.readers:
        W = tensors[w].to(torch.float64).clone()
        W.index_copy_(axis, idx, W.index_select(axis, idx) / factor)
        out[w] = W
    return out


def with_outliers(model, channels: int = 4, factor: float = 30.0, seed: int = 0, *, untie: bool = True,
                  inputs=None, tol: float = 1e-5) -> Outliers:
    """A copy of ``model`` with ``channels`` outlier channels (×``factor``) at the input of every
    reader of a foldable norm (see the module docstring); the same channels, drawn from ``seed``,
    for every norm of one width. ``untie``: untie the head where that lets the final norm fold,
    as :func:`symgraph.rotate` does. Raises :class:`InputError` when the report folds no norm,
    :class:`CertificationError` when the outputs change by more than ``tol`` (relative)."""
    if channels < 1 or not factor > 0:
        raise InputError(f"channels={channels}, factor={factor}; expected channels >= 1 and factor > 0")
    base, report, untied = rotation_report(model, untie=untie, inputs=inputs)
    tensors = stored_tensors(report, base, check=True)
    folds = [f for f in report.folds if f.gain in tensors]
    if not folds:
        raise InputError(f"{report.model_name} has no foldable norm gain: no norm's readers to give outliers")
    gen = torch.Generator().manual_seed(seed)
    picked: dict = {}
    values: dict = {}
    for f in folds:
        width = tensors[f.gain].numel()
        if channels > width:
            raise InputError(f"channels={channels}; norm {f.gain!r} has only {width}")
        if width not in picked:
            picked[width] = torch.randperm(width, generator=gen)[:channels].sort().values
        values.update(_scaled(f, tensors, picked[width], factor))
    error = certificate(base, values, report)
    if error > tol:
        raise CertificationError(f"outliers changed {report.model_name}'s outputs by {error:.3g} (relative), "
                                 f"expected at most {tol:g}")
    new = copy.deepcopy(base)
    write_state(new, values, report.buffers)
    return Outliers(new, {w: i.tolist() for w, i in picked.items()}, [f.gain for f in folds], untied, error)
