"""Function-preserving rotations for quantization (QuaRot, Ashkboos et al. 2024; SpinQuant,
Liu et al. 2024), chosen from the symmetry report instead of written per architecture.

:func:`rotate` analyses the model, folds every norm gain (and LayerNorm shift, where the
readers have biases) into the layers that read it, and applies one element of each rotation
class the report gives: the residual stream once its norms fold (``"orthogonal"`` for RMSNorm
streams; ``"orthogonal_mean"``, the maps fixing 𝟙, for LayerNorm streams) and each head's
value-output map. The result is a model of the same class whose folded norm gains are one,
certified: its outputs equal the original's (float32, ``tol`` relative).

A tied output head fixes the residual stream's basis (the final norm's gain cannot fold into a
matrix the embedding also uses), so where untying frees the stream ``rotate`` unties it
first (``tie_word_embeddings=False``: one more ``vocabulary × width`` matrix); with
``untie=False`` only the per-head value-output maps rotate. A post-norm model (BERT: the norm
sits on the stream itself) has no stream rotation either: its report says ``perm``.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from ..core.elements import mark_orth
from ..core.hadamard import KINDS as ROTATION_KINDS, incoherent
from ..errors import CertificationError, InputError
from ..passes.trace import eval_mode, flatten_outputs, output_deviation, select_outputs
from ..report.api import analyze, tied_parameters
from ..transform.apply import move, stored_tensors, write_state
from .untie import untie as untie_model

__all__ = ["rotate", "RotateResult", "HOW", "CLASSES", "rotation_classes", "rotation_elements",
           "ones_gauge", "rotated_state", "rotation_report"]

#: The elements :func:`rotate` draws: a randomized Hadamard, a Haar-random rotation, or learned.
HOW = ("hadamard", "random", "learned")
#: The classes it can rotate: the residual stream, each head's value-output map, each head's
#: query-key map (a non-RoPE model's; no quantizer reads its activations).
CLASSES = ("stream", "vo", "qk")


@dataclass
class RotateResult:
    """What :func:`rotate` returns: the rotated ``model`` (a new object), its ``report`` (of the
    model as rotated: untied where untying freed the stream), the ``elements`` applied
    (``{group id: [*fibres, n, n] float64}``), which group ids each class role took
    (``roles``), whether the head was ``untied``, the certificate ``error`` (largest relative
    change of the outputs, float32) and, for ``how="learned"``, what training did."""
    model: torch.nn.Module
    report: object
    elements: dict
    roles: dict
    untied: bool
    error: float
    how: str
    learned: dict = field(default_factory=dict)


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
    the folded values (the form a rotated model is written in)."""
    out = {}
    for f in report.folds:
        if f.gain in tensors:
            out[f.gain] = torch.ones(report.param_shape(f.gain), dtype=torch.float64)
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


def rotate(model, how: str = "hadamard", seed: int = 0, *, data=None, classes=("stream", "vo"),
           untie: bool = True, inputs=None, outputs=None, tol: float = 1e-5, **learn) -> RotateResult:
    """A copy of ``model`` rotated for quantization (see the module docstring).

    ``how``: ``"hadamard"`` (a randomized Hadamard where the width allows, else random
    orthogonal), ``"random"`` (Haar-random), or ``"learned"`` (SpinQuant-style: start from the
    Hadamard element and minimise the fake-quantized model's loss on ``data``, an iterable of
    keyword batches; ``learn`` takes ``steps``, ``lr``, ``weight_bits``, ``act_bits``,
    ``group_size``, ``loss_fn``: :func:`symgraph.merging.rotate_learned.learn_rotations`).
    ``classes``: the roles to rotate (:data:`CLASSES`). ``inputs``: the inputs to trace and
    certify with (default: built from the config). Raises :class:`CertificationError` when the
    rotated model's outputs differ by more than ``tol`` (relative, float32)."""
    if how not in HOW:
        raise InputError(f"how={how!r}; expected one of {list(HOW)}")
    if how == "learned" and not data:
        raise InputError("how='learned' needs data: an iterable of keyword batches (input_ids) to learn on")
    if how != "learned" and learn:
        raise InputError(f"options {sorted(learn)} are for how='learned' only")
    base, report, untied = rotation_report(model, untie=untie, inputs=inputs, outputs=outputs)
    roles = rotation_classes(report, classes)
    elements = rotation_elements(report, roles, how, seed)
    tensors = stored_tensors(report, base, check=True)
    trained: dict = {}
    if how == "learned":
        from .rotate_learned import learn_rotations
        elements, trained = learn_rotations(base, report, elements, data, seed=seed, **learn)
    new_values = rotated_state(report, elements, tensors)
    rotated = copy.deepcopy(base)
    write_state(rotated, new_values, report.buffers)
    error = certificate(base, rotated, report)
    if error > tol:
        raise CertificationError(f"rotated {report.model_name}'s outputs differ by {error:.3g} (relative), "
                                 f"expected at most {tol:g}")
    return RotateResult(rotated, report, elements, roles, untied, error, how, trained)


def certificate(model, rotated, report) -> float:
    """The largest relative change of the outputs (those ``report`` keeps) between ``model``
    and ``rotated``, both run in float32 on the report's inputs."""
    args, kwargs = report.inputs
    got = []
    for m in (model, rotated):
        m32 = copy.deepcopy(m).float()
        with torch.no_grad(), eval_mode(m32):
            got.append(flatten_outputs(select_outputs(m32(*args, **kwargs), report.outputs)))
    return output_deviation(*got)
