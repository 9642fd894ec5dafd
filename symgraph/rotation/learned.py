"""Learned rotations (SpinQuant, Liu et al. 2024): the rotation classes' elements optimised so
that the fake-quantized rotated model has low loss on data.

Learned matching's machinery does the work (:mod:`symgraph.alignment.learning`): its one step
loop (:func:`~symgraph.alignment.learning.optimise`: Adam, batch ``k mod len(data)`` at step
``k``, no ``λ``), its parametrisation of each class on its group
(``torch.nn.utils.parametrizations.orthogonal``; the maps fixing 𝟙 as ``H diag(1, R) Hᵀ``),
its model run on other values (``Bound``), its loss (the model's own) and its exact
projection back onto the group at the end. Each step
rotates the weights with the current elements (norm gains folded), rounds the linear layers'
weights (RTN, ``weight_bits``, groups of ``group_size``) and their inputs (per token,
``act_bits``) with a straight-through estimator (:mod:`symgraph.testing.quantize`), and takes
an Adam step on the loss. The elements kept are those, of the start and the end, with the lower
quantized loss on the training batches: never worse than the start there.
"""
from __future__ import annotations

import contextlib
import time
from types import SimpleNamespace

import torch

from ..alignment.learning import learnable, optimise, summary
from ..alignment.refine import Bound, default_loss
from ..errors import InputError
from ..passes.trace import eval_mode
from ..testing import quantize as Q
from ..transform.apply import stored_tensors
from .classes import rotated_state

__all__ = ["learn_rotations", "quantized_loss"]


def _values(model, report, elements, tensors, wbits, group, ste=True) -> dict:
    """Every parameter of ``model`` (tied names included) rotated by ``elements``, the linear
    layers' weights rounded to ``wbits`` bits (None: kept)."""
    moved = rotated_state(report, elements, tensors)
    out = {}
    for k, p in model.named_parameters(remove_duplicate=False):
        v = moved.get(k)
        out[k] = p.detach() if v is None else v.to(p.dtype)
    for keep, others in report.aliases.items():
        out.update({o: out[keep] for o in others if keep in out})
    return out if wbits is None else Q.weight_values(model, out, wbits, group, ste=ste)


def quantized_loss(model, report, elements, tensors, batches, *, weight_bits=4, act_bits=8, group_size=128,
                   loss_fn=None) -> float:
    """Mean loss on ``batches`` of ``model`` rotated by ``elements`` and fake-quantized
    (weights RTN ``weight_bits``/``group_size``, inputs per token ``act_bits``; None: not rounded)."""
    loss_fn = loss_fn or default_loss
    got = []
    with torch.no_grad(), _acts(model, act_bits, ste=False):
        vals = _values(model, report, elements, tensors, weight_bits, group_size, ste=False)
        for b in batches:
            got.append(float(loss_fn(Bound(model, vals), b)))
    return sum(got) / len(got)


def _acts(model, bits, ste):
    return contextlib.nullcontext() if bits is None else Q.activations(model, bits, ste=ste)


def learn_rotations(model, report, elements: dict, data, *, steps: int = 50, lr: float = 1e-3,
                    weight_bits: int | None = 4, act_bits: int | None = 8, group_size: int = 128,
                    loss_fn=None, progress: bool = False, keep_best: bool = True):
    """``(elements, info)``: ``elements`` (``{group id: rotation}``, the start) optimised for
    ``steps`` Adam steps on ``data`` (a list of keyword batches, step ``k`` on batch ``k mod
    len(data)``; nothing random is drawn), see the module docstring.
    ``info``: ``steps``, ``classes``, ``loss_first``/``loss_last`` (training, fake-quantized),
    ``start``/``end`` (mean quantized loss on ``data`` without the estimator), ``kept``
    (``"learned"`` or ``"start"``; ``keep_best=False``: always the learned), ``seconds``."""
    data = list(data)
    if not data:
        raise InputError("learned rotations need data: a non-empty list of keyword batches (input_ids)")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise InputError(f"steps={steps!r}; expected a positive number of optimisation steps")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 < lr < float("inf"):
        raise InputError(f"lr={lr!r}; expected a positive step size")
    for name, bits in (("weight_bits", weight_bits), ("act_bits", act_bits)):
        if bits is not None and (isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 16):
            raise InputError(f"{name}={bits!r}; expected a number of bits from 2 to 16, or None (not rounded)")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise InputError(f"group_size={group_size!r}; expected a positive number of weights per quantization group")
    learn = learnable(report, SimpleNamespace(elements=dict(elements)))
    tensors = stored_tensors(report, model, check=True)
    opts = dict(weight_bits=weight_bits, act_bits=act_bits, group_size=group_size, loss_fn=loss_fn)
    start = quantized_loss(model, report, elements, tensors, data, **opts)
    if not learn:
        return elements, {"steps": 0, "classes": 0, "start": start, "end": start, "kept": "start"}
    t0 = time.perf_counter()
    loss_fn = loss_fn or default_loss

    def step(live: dict, batch) -> float:
        with _acts(model, act_bits, ste=True):
            vals = _values(model, report, {**elements, **live}, tensors, weight_bits, group_size)
            loss = loss_fn(Bound(model, vals), batch)
        loss.backward()
        return loss.item()
    with eval_mode(model):
        losses = optimise(learn, step, data, steps, lr, desc="learn rotations", progress=progress)
    learned = {**elements, **{gid: x.final() for gid, x in learn.items()}}
    end = quantized_loss(model, report, learned, tensors, data, **opts)
    better = end <= start or not keep_best
    info = {**summary(losses, steps, len(learn), time.perf_counter() - t0), "start": start, "end": end,
            "kept": "learned" if better else "start"}
    return (learned if better else elements), info
