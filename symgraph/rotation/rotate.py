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

from ..core.finite import batch_list
from ..errors import CertificationError, InputError
from ..transform.apply import stored_tensors, write_state
from .learned import learn_rotations
from .classes import CLASSES, certificate, rotated_state, rotation_classes, rotation_elements, rotation_report

__all__ = ["rotate", "RotateResult", "HOW", "CLASSES"]

#: The elements :func:`rotate` draws: a randomized Hadamard, a Haar-random rotation, or learned.
HOW = ("hadamard", "random", "learned")


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


def rotate(model, how: str = "hadamard", seed: int = 0, *, data=None, classes=("stream", "vo"),
           untie: bool = True, inputs=None, outputs=None, tol: float = 1e-5, **learn) -> RotateResult:
    """A copy of ``model`` rotated for quantization (see the module docstring).

    ``how``: ``"hadamard"`` (a randomized Hadamard where the width allows, else random
    orthogonal), ``"random"`` (Haar-random), or ``"learned"`` (SpinQuant-style: start from the
    Hadamard element and minimise the fake-quantized model's loss on ``data``, an iterable of
    keyword batches; ``learn`` takes ``steps``, ``lr``, ``weight_bits``, ``act_bits``,
    ``group_size``, ``loss_fn``: :func:`symgraph.rotation.learned.learn_rotations`).
    ``classes``: the roles to rotate (:data:`CLASSES`). ``inputs``: the inputs to trace and
    certify with (default: built from the config). Raises :class:`CertificationError` when the
    rotated model's outputs differ by more than ``tol`` (relative, float32; a 16-bit model is
    certified on its rotated values before they are rounded to its dtype)."""
    from ..core.schema import SEED
    if how not in HOW:
        raise InputError(f"how={how!r}; expected one of {list(HOW)}")
    SEED.check(seed, "seed=")
    if isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 < tol < float("inf"):
        raise InputError(f"tol={tol!r}; expected a positive number (the largest relative change of the outputs)")
    classes = (classes,) if isinstance(classes, str) else classes
    if how == "learned" and data is None:
        raise InputError("how='learned' needs data: an iterable of keyword batches (input_ids) to learn on")
    if how != "learned" and (learn or data is not None):  # used by no step: refused, never ignored
        given = sorted(learn) + (["data"] if data is not None else [])
        raise InputError(f"options {given} are for how='learned' only; expected how='learned' or no {given[0]}")
    data = batch_list(data, model)
    base, report, untied = rotation_report(model, untie=untie, inputs=inputs, outputs=outputs)
    roles = rotation_classes(report, classes)
    elements = rotation_elements(report, roles, how, seed)
    tensors = stored_tensors(report, base, check=True)
    trained: dict = {}
    if how == "learned":
        elements, trained = learn_rotations(base, report, elements, data, **learn)
    new_values = rotated_state(report, elements, tensors)
    rotated = copy.deepcopy(base)
    write_state(rotated, new_values, report.buffers)
    error = certificate(base, new_values, report)
    if error > tol:
        raise CertificationError(f"rotated {report.model_name}'s outputs differ by {error:.3g} (relative), "
                                 f"expected at most {tol:g}")
    return RotateResult(rotated, report, elements, roles, untied, error, how, trained)
