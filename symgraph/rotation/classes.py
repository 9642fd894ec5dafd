"""The pieces of :func:`symgraph.rotate` (see :mod:`symgraph.rotation.rotate`): which classes a
rotation acts on, an incoherent element of each, the rotated values with norm gains folded to
one, the model to rotate (untied where that frees the stream) and the certificate."""
from __future__ import annotations

import copy

import torch

from ..core.elements import mark_orth
from ..core.hadamard import KINDS as ROTATION_KINDS, incoherent
from ..errors import InputError
from ..passes.trace import eval_mode, flatten_outputs, output_deviation, select_outputs
from ..report.api import analyze, tied_parameters
from ..transform.apply import move, write_state
from ..core.ties import untie as untie_model

__all__ = ["CLASSES", "rotation_classes", "rotation_elements", "ones_gauge", "rotated_state", "rotation_report",
           "certificate"]

#: The classes a rotation can act on: the residual stream, each head's value-output map, each
#: head's query-key map (a non-RoPE model's; no quantizer reads its activations).
CLASSES = ("stream", "vo", "qk")


def rotation_classes(report, classes=("stream", "vo")) -> dict:
    """``{role: [group id, ...]}`` of the report's classes a rotation can act on: ``"stream"``
    every orthogonal class that is no attention head's, ``"vo"`` / ``"qk"`` the heads'
    value-output / query-key classes of an orthogonal or general linear kind."""
    bad = [c for c in classes if c not in CLASSES]
    if bad:
        raise InputError(f"rotation classes {bad}; expected some of {list(CLASSES)}")
    kinds = {g.id: g.kind for g in report.groups}
    att = report.attention_groups()
    heads = {"vo": [s["vo"] for s in att], "qk": [s["qk"] for s in att]}
    taken = {gid for ids in heads.values() for gid in ids}
    out = {"stream": [g.id for g in report.groups if g.kind in ("orthogonal", "orthogonal_mean")
                      and g.id not in taken]}
    for role, ids in heads.items():
        out[role] = list(dict.fromkeys(g for g in ids if g is not None and kinds[g] in ROTATION_KINDS))
    return {role: out[role] for role in CLASSES if role in classes}


def rotation_elements(report, roles: dict, how: str = "hadamard", seed: int = 0) -> dict:
    """One incoherent element per class of ``roles`` (:func:`rotation_classes`), drawn from
    ``seed``: randomized Hadamard (``how="hadamard"``, where an order is known; see
    :func:`symgraph.core.hadamard.incoherent`) or Haar-random (``how="random"``), in each
    class's group (LayerNorm streams: the maps fixing 𝟙), one per head where the class is
    fibred over heads."""
    gen = torch.Generator().manual_seed(seed)
    kind = {g.id: g for g in report.groups}
    out = {}
    for gid in (g for ids in roles.values() for g in ids):
        g = kind[gid]
        out[gid] = mark_orth(incoherent(g.kind, g.dim, gen, batch=report.fibre_shape(gid),
                                        how="random" if how == "random" else "hadamard"))
    return out


def ones_gauge(report, tensors: dict) -> dict:
    """Gains of one and shifts of zero for every fold of ``report``: unfolding into them leaves
    the folded values (the form a rotated model is written in). A gain read with an offset
    (Gemma's ``1 + w``) is one where its parameter is ``1 − offset``."""
    out = {}
    for f in report.folds:
        if f.gain in tensors:
            out[f.gain] = torch.full(report.param_shape(f.gain), 1.0 - f.offset, dtype=torch.float64)
        if f.shift and f.shift in tensors:
            out[f.shift] = torch.zeros(report.param_shape(f.shift), dtype=torch.float64)
    return out


def rotated_state(report, elements: dict, tensors: dict) -> dict:
    """New values (float64) of every tensor that folding or ``elements`` change, gains folded
    to one: :func:`symgraph.transform.apply.move` unfolded into :func:`ones_gauge`."""
    return move(report, elements, tensors, gauge=ones_gauge(report, tensors) or None)


def _freed(report) -> bool:
    return bool(rotation_classes(report, ("stream",))["stream"])


def rotation_report(model, untie: bool = True, inputs=None, outputs=None):
    """``(model, report, untied)``: the model to rotate (untied where that frees the residual
    stream and ``untie``) and its report."""
    report = analyze(model, inputs, outputs=outputs)
    if untie and tied_parameters(model) and not _freed(report):
        loose = untie_model(model)
        loose_report = analyze(loose, inputs, outputs=outputs)
        if _freed(loose_report):
            return loose, loose_report, True
    return model, report, False


def certificate(model, values: dict, report) -> float:
    """The largest relative change of the outputs (those ``report`` keeps) between ``model``
    and ``model`` with its tensors replaced by ``values`` (the rotated ones, before any cast to a
    16-bit dtype), both run in float32 on the report's inputs."""
    args, kwargs = report.inputs
    base = copy.deepcopy(model).float()
    rotated = copy.deepcopy(base)
    write_state(rotated, values, report.buffers)
    got = []
    for m in (base, rotated):
        with torch.no_grad(), eval_mode(m):
            got.append(flatten_outputs(select_outputs(m(*args, **kwargs), report.outputs)))
    return output_deviation(*got)
