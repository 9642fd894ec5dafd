"""The certificate of a report: random elements of every group applied to the model, its
outputs compared, and the extra runs its program was traced with (issue 65) too (float64
throughout; see :func:`certify`)."""
from __future__ import annotations

import contextlib
import copy
import warnings

import torch

from ..core.dtypes import wide_floats
from ..passes.entry_points import EntryPoint, entry_results
from ..passes.holder_inputs import HOLDERS, Injection, substituted
from ..passes.training_runs import TrainingRun, training_results
from ..passes.trace import eval_mode, flatten_outputs, graph_friendly, output_deviation, select_outputs, split_inputs
from ..errors import CertificationError, InputError

__all__ = ["certify", "cast_floats", "deviation", "extra_runs", "FLOAT32_TOL"]

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

    The extra runs the program was traced with (the graph meta's ``HOLDERS``: a holder run on an
    injected argument, another method run beside the forward, a module run in training mode) are
    judged as well, on the report's own inputs (where they were found), in the same worst
    deviation: the program adds them as ``0 *`` their results, so the outputs alone never see
    them. A holder's run returns values of its output's space, which the symmetry moves: it is
    judged by the model's outputs with that run in place of the holder's result
    (:func:`.holder_inputs.substituted`, one run per injection and trial); a method's results
    and a training run's (:func:`.training_runs.training_results`, under a fixed generator),
    which the analysis keeps fixed, directly.
    """
    from ..transform.apply import check_model
    if any(p.is_meta for p in model.parameters()):
        raise InputError("cannot certify a model on the meta device: it has no weights")
    check_model(report, model, "the model to certify")
    args, kwargs = split_inputs(model, inputs) if inputs is not None else report.inputs
    try:
        (worst, where), used = _certify_in(report, model, args, kwargs, trials, torch.float64), tol
    except RuntimeError as e:
        if "Double" not in str(e) and "double" not in str(e):
            raise
        worst = None
        if hasattr(model, "set_experts_implementation"):
            try:
                (worst, where), used = _certify_in(report, model, args, kwargs, trials, torch.float64, "eager"), tol
            except (RuntimeError, ValueError):
                worst = None
        if worst is None:
            used = max(tol, FLOAT32_TOL)
            warnings.warn(f"{report.model_name} cannot run in float64 ({str(e).splitlines()[0][:120]}); "
                          f"certified in float32 against a tolerance of {used:g}", stacklevel=3)
            worst, where = _certify_in(report, model, args, kwargs, trials, torch.float32)
    assert worst is not None  # the float32 run above returns a number or raises
    if worst > used:
        raise CertificationError(
            f"symmetry certificate failed for {report.model_name}: transformed {where} differ "
            f"by {worst:.3g} (relative), expected at most {used:g}")
    return worst


def _certify_in(report, model, args, kwargs, trials, dtype, experts=None) -> tuple[float, str]:
    """The worst deviation over ``trials`` in ``dtype``, and what showed it (the outputs, or
    an extra run: see :func:`certify`)."""
    from ..transform.apply import transform
    m = copy.deepcopy(model).to(dtype)
    if experts:
        m.set_experts_implementation(experts)
    args, kwargs = cast_floats(args, dtype), cast_floats(kwargs, dtype)
    extras = extra_runs(report)
    own = cast_floats(report.inputs, dtype) if extras else ((), {})
    worst, where = 0.0, "outputs"
    wide = wide_floats() if dtype == torch.float64 else contextlib.nullcontext()
    with torch.no_grad(), eval_mode(m), graph_friendly(m), wide:
        base = flatten_outputs(select_outputs(m(*args, **kwargs), report.outputs))
        if any(bool(b.isnan().any()) for b in base):  # before any transform: nothing to judge against
            raise InputError(f"{report.model_name} computes NaN on these inputs before any transform, so no "
                             "transform can be judged; expected inputs on which the model's outputs are numbers")
        base_extra = [_extra_values(m, e, own, report.outputs) for e in extras]
        for trial in range(trials):
            mt = transform(m, report.random_transform(seed=trial))
            with eval_mode(mt), graph_friendly(mt):
                out = flatten_outputs(select_outputs(mt(*args, **kwargs), report.outputs))
                got = [("outputs", deviation(base, out))] + [
                    (f"values of {_named(e)}", deviation(b, _extra_values(mt, e, own, report.outputs)))
                    for e, b in zip(extras, base_extra)]
            del mt  # one transformed copy at a time (the next is built from m, not from it)
            for name, d in got:
                if d > worst:  # deviation is never NaN
                    worst, where = d, name
    return worst, where


def deviation(base: list, out: list) -> float:
    """:func:`~symgraph.passes.trace.output_deviation` where a value that is not finite must be
    kept: the same infinity at the same place (a logit masked to ``-inf``) is kept and the finite
    values are compared; a NaN, or an infinity moved or gained, is a deviation without bound
    (``inf``: a comparison that skipped a NaN would certify a transform that breaks the model)."""
    d = output_deviation(base, out)
    if d == d:
        return d
    kept_a, kept_b = [], []
    for a, b in zip(base, out):
        bad = ~torch.isfinite(a)
        if a.isnan().any() or b.isnan().any() or not torch.equal(bad, ~torch.isfinite(b)) \
                or not torch.equal(a[bad], b[bad]):
            return float("inf")
        kept_a.append(torch.where(bad, 0, a))
        kept_b.append(torch.where(bad, 0, b))
    return output_deviation(kept_a, kept_b)


def extra_runs(report) -> list:
    """The extra runs ``report``'s program was traced with: the holders' injections
    (:class:`.holder_inputs.Injection`), the other methods run beside the forward
    (:class:`.entry_points.EntryPoint`) and the modules run in training mode
    (:class:`.training_runs.TrainingRun`); none for a report without a program."""
    try:
        meta = report.exported_program.graph_module.meta
    except AttributeError:
        return []
    return list(meta.get(HOLDERS, []))


def _named(extra) -> str:
    if isinstance(extra, Injection):
        return f"the model with {extra.path} run on its {extra.arg}"
    if isinstance(extra, TrainingRun):
        return f"{extra.path or 'the model'} run in training mode{' on labels' if extra.labels else ''}"
    return f"{extra.path + '.' if extra.path else ''}{extra.method}"


def _extra_values(m, extra, inputs: tuple, outputs) -> list:
    """The values ``extra`` is judged by on ``m`` run on ``inputs``, ``(args, kwargs)`` (see
    :func:`certify`)."""
    args, kwargs = inputs
    if isinstance(extra, EntryPoint):
        return entry_results(m, extra, args, kwargs)
    if isinstance(extra, TrainingRun):
        values = training_results(m, extra, args, kwargs)
        if not values:
            raise CertificationError(f"{_named(extra)}: the run was not made on the report's inputs, so it "
                                     "cannot be judged")
        return values
    with substituted(m, extra) as hook:
        out = flatten_outputs(select_outputs(m(*args, **kwargs), outputs))
    if not hook.joined:
        raise CertificationError(f"{_named(extra)}: the holder's run did not take the place of its "
                                 "result on the report's inputs, so it cannot be judged")
    return out


def cast_floats(x, dtype):
    """The floating-point tensors of ``x`` (a tensor, dict, tuple or list) in ``dtype``; the rest as is."""
    if isinstance(x, torch.Tensor):
        return x.to(dtype) if x.is_floating_point() else x
    if isinstance(x, dict):
        return {k: cast_floats(v, dtype) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(cast_floats(v, dtype) for v in x)
    return x
