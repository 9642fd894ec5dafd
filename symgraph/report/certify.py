"""The certificate of a report: random elements of every group applied to the model, its
outputs compared (float64 throughout; see :func:`certify`)."""
from __future__ import annotations

import contextlib
import copy
import warnings

import torch

from ..core.dtypes import wide_floats
from ..passes.trace import eval_mode, flatten_outputs, graph_friendly, output_deviation, select_outputs, split_inputs
from ..errors import CertificationError, InputError

__all__ = ["certify", "cast_floats", "FLOAT32_TOL"]

FLOAT32_TOL = 1e-4  # certificates of models that cannot run in float64


def certify(report, model, inputs=None, trials: int = 3, tol: float = 1e-6) -> float:
    """Apply random elements of every group of ``report`` in float64; return the worst relative
    change of the outputs, raising :class:`CertificationError` above ``tol``.

    Float64 throughout (:func:`wide_floats`): many models cast to float32 inside (a norm's
    variance, a softmax's ``dtype=``, a state-space scan's ``.float()``), and those casts alone
    put an exact symmetry at 1e-7..1e-6 (a deep or ill-conditioned one, such as a random
    ``gl`` class, at the tolerance). Under :func:`wide_floats` they keep float64, so a sound
    report certifies at float64 round-off (~1e-14) and a wrong one far above it.

    Mixture-of-experts models of Hugging Face, whose grouped matmul has no float64 kernel, are
    certified in float64 through their own eager experts loop (``set_experts_implementation``).
    A model with another op that has no float64 kernel is certified in float32 against
    ``max(tol, FLOAT32_TOL)``, with a warning that says so.
    """
    if any(p.is_meta for p in model.parameters()):
        raise InputError("cannot certify a model on the meta device: it has no weights")
    args, kwargs = split_inputs(model, inputs) if inputs is not None else report.inputs
    try:
        worst, used = _certify_in(report, model, args, kwargs, trials, torch.float64), tol
    except RuntimeError as e:
        if "Double" not in str(e) and "double" not in str(e):
            raise
        worst = None
        if hasattr(model, "set_experts_implementation"):
            try:
                worst, used = _certify_in(report, model, args, kwargs, trials, torch.float64, "eager"), tol
            except (RuntimeError, ValueError):
                worst = None
        if worst is None:
            used = max(tol, FLOAT32_TOL)
            warnings.warn(f"{report.model_name} cannot run in float64 ({str(e).splitlines()[0][:120]}); "
                          f"certified in float32 against a tolerance of {used:g}", stacklevel=3)
            worst = _certify_in(report, model, args, kwargs, trials, torch.float32)
    assert worst is not None  # the float32 run above returns a number or raises
    if worst > used:
        raise CertificationError(
            f"symmetry certificate failed for {report.model_name}: transformed outputs differ "
            f"by {worst:.3g} (relative), expected at most {used:g}")
    return worst


def _certify_in(report, model, args, kwargs, trials, dtype, experts=None) -> float:
    from ..transform.apply import transform
    m = copy.deepcopy(model).to(dtype)
    if experts:
        m.set_experts_implementation(experts)
    args, kwargs = cast_floats(args, dtype), cast_floats(kwargs, dtype)
    worst = 0.0
    wide = wide_floats() if dtype == torch.float64 else contextlib.nullcontext()
    with torch.no_grad(), eval_mode(m), graph_friendly(m), wide:
        base = flatten_outputs(select_outputs(m(*args, **kwargs), report.outputs))
        for trial in range(trials):
            mt = transform(m, report.random_transform(seed=trial))
            with eval_mode(mt), graph_friendly(mt):
                out = flatten_outputs(select_outputs(mt(*args, **kwargs), report.outputs))
            worst = max(worst, output_deviation(base, out))
    return worst


def cast_floats(x, dtype):
    """The floating-point tensors of ``x`` (a tensor, dict, tuple or list) in ``dtype``; the rest as is."""
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, dict):
        return {k: cast_floats(v, dtype) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(cast_floats(v, dtype) for v in x)
    return x
