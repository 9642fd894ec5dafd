"""Evaluating merges: losses along the linear path between two models, and the loss barrier."""
from __future__ import annotations

import copy

import numpy as np
import torch

from ..checkpoints.specs import check_same_configs
from ..core.progress import bar
from ..errors import InputError

__all__ = ["interpolate", "loss_barrier", "streamed_curve", "interpolated_fetch", "LossPrograms", "NO_LOSS"]


#: The most values of λ a barrier curve takes (a step of 0.001; each point evaluates the loss on all the data).
MAX_POINTS = 1001


def check_points(points, name: str = "points") -> int:
    """``points`` (the values of λ along a line, the ends included) as an int, or refused
    naming ``name`` (``--points`` on the command line) and the accepted range."""
    if isinstance(points, bool) or not isinstance(points, (int, np.integer)) or not 3 <= points <= MAX_POINTS:
        raise InputError(f"{name} {points!r}: expected at least 3 and at most {MAX_POINTS} values of λ (the ends "
                         f"and a middle; {MAX_POINTS} is a step of {1 / (MAX_POINTS - 1):g})")
    return int(points)


def interpolate(a, b, lambdas=None, loss_fn=None, attention: str = "heads"):
    """Losses along ``λθ_A + (1−λ)θ_B``; returns ``[(λ, loss), ...]`` (21 points by default).

    θ is every parameter and every floating-point buffer (a BatchNorm's running statistics move
    with its weights; integer buffers, e.g. batch counts, are A's), so λ = 0 is B and λ = 1 is A.
    ``lambdas``: values in [0, 1]; ``loss_fn(model)`` returns a finite number.

    ``attention="circuits"``: along the circuit-space line instead (Theus et al. 2025): every
    head computes ``λ·QK_A + (1−λ)·QK_B`` and ``λ·OV_A + (1−λ)·OV_B``
    (:func:`symgraph.merging.driver.circuit_merge`); the end points are A and B."""
    from ..core.finite import require_module
    if not callable(loss_fn):
        raise InputError(f"loss_fn is {'missing' if loss_fn is None else type(loss_fn).__name__}; "
                         "interpolate needs loss_fn(model) -> float")
    lambdas = np.linspace(0, 1, 21) if lambdas is None else check_lambdas(lambdas)
    if attention not in ("heads", "circuits"):
        raise InputError(f"attention={attention!r}; expected 'heads' or 'circuits'")
    require_module(a, "a")
    require_module(b, "b")
    sa, sb = _state(a), _state(b)
    for k in sa.keys() | sb.keys():
        if k not in sa or k not in sb or sa[k].shape != sb[k].shape:
            where = ("only " + ("A" if k in sa else "B") + " has it") if k not in sa or k not in sb else \
                f"shapes {tuple(sa[k].shape)} vs {tuple(sb[k].shape)}"
            raise InputError(f"models differ at {k!r} ({where}); interpolate needs the same tensors of the same shapes")
    # every point runs in A's config: a field of B's that changes the function would be dropped
    check_same_configs([getattr(m, "config", None) for m in (a, b)], ["a", "b"])
    if attention == "circuits":
        from ..report import analyze
        from ..merging.driver import circuit_merge
        rep = analyze(a)
        return [(float(lam), _loss(loss_fn, circuit_merge([a, b], [lam, 1 - lam], rep), lam)) for lam in lambdas]
    m = copy.deepcopy(a)
    mine = {k: v for k, v in _state(m).items() if v.is_floating_point() and not torch.equal(sa[k], sb[k])}
    curve = []
    for lam in bar(lambdas, desc="barrier", unit="point"):
        with torch.no_grad():
            for k, t in mine.items():
                t.copy_(lam * sa[k] + (1 - lam) * sb[k])
        curve.append((float(lam), _loss(loss_fn, m, lam)))
    return curve


def _state(model) -> dict:
    """``{name: tensor}`` of the model's parameters and buffers (each tied tensor once)."""
    return dict(model.named_parameters()) | dict(model.named_buffers())


def _loss(loss_fn, model, lam) -> float:
    """``loss_fn(model)`` as a float, refused unless it is one finite number."""
    v = loss_fn(model)
    try:
        v = float(v)
    except (TypeError, ValueError, RuntimeError):
        raise InputError(f"loss_fn returned {type(v).__name__} {tuple(getattr(v, 'shape', ()))} at λ = {lam:g}; "
                         "expected one number") from None
    if not np.isfinite(v):
        raise InputError(f"loss_fn returned {v} at λ = {lam:g}; expected a finite loss")
    return v


def check_lambdas(lambdas) -> list:
    """``lambdas`` as a list of floats, refused unless it is a non-empty sequence of numbers in
    [0, 1]."""
    try:
        values = [float(x) for x in lambdas]
    except (TypeError, ValueError):
        raise InputError(f"lambdas {lambdas!r}: expected a sequence of numbers in [0, 1]") from None
    bad = [x for x in values if not 0.0 <= x <= 1.0]  # NaN fails both comparisons
    if not values or bad:
        raise InputError(f"lambdas {lambdas!r}: expected a non-empty sequence of numbers in [0, 1] "
                         f"(λ = 1 is A, λ = 0 is B)" + (f"; {bad[0]} is not" if bad else ""))
    return values


def loss_barrier(curve) -> float:
    """``max_λ L(λ) − ½(L(θ_A) + L(θ_B))`` (Verma & Elbayad 2024), with θ_A at λ=1 and θ_B at λ=0."""
    try:
        curve = sorted((float(lam), float(loss)) for lam, loss in curve)
    except (TypeError, ValueError):
        raise InputError(f"loss_barrier takes a curve [(λ, loss), ...], as interpolate returns; got {curve!r:.80}") \
            from None
    if len(curve) < 2:
        raise InputError("loss_barrier needs at least the two end points")
    if not all(np.isfinite(v) for point in curve for v in point):
        raise InputError("loss_barrier's curve holds a value that is not finite; expected finite λ and losses")
    lo, hi = curve[0][1], curve[-1][1]
    return max(l for _, l in curve) - 0.5 * (lo + hi)


def interpolated_fetch(A, B, lam: float, al=None):
    """``fetch(name)`` of the model ``λθ_A + (1−λ)θ_B′`` read from checkpoints ``A`` and ``B``
    (:class:`~symgraph.checkpoints.sharded.Checkpoint`), ``B′`` being B moved by the alignment
    ``al`` (None: B as it is). A norm fold's tensors are moved together when one of them is
    first read and kept until each is read; integer tensors are A's. Computed in float32
    (float64 for float64 tensors), returned in A's dtype."""
    from ..transform.apply import move
    rb = al.report_b if al is not None else None
    unit = rb.fold_groups if rb is not None else {}
    moved = set(rb.parameters) | set(rb.buffers) if rb is not None else set()
    canon = {o: k for k, others in rb.aliases.items() for o in others} if rb is not None else {}
    held: dict = {}

    def b_value(name):
        name = canon.get(name, name)  # a tied name: the reported one moves
        if name in held:
            return held.pop(name)
        if name not in moved:
            return B.fetch(name)
        names = unit.get(name, (name,))
        vals = {n: B.fetch(n) for n in names}
        gauge = {n: al.gauge[n] for n in names if n in (al.gauge or {})} or None
        new = move(rb, al.elements, vals, gauge)
        held.update({n: new.get(n, vals[n]) for n in names if n != name})
        return new.get(name, vals[name])

    def fetch(name):
        a, b = A.fetch(name), b_value(name)
        if not a.is_floating_point():
            return a
        work = torch.promote_types(a.dtype, torch.float32)
        return (lam * a.to(work) + (1 - lam) * b.to(work)).to(a.dtype)
    return fetch


#: What a barrier refused for want of a loss expects: the loss is the model's own on the data.
NO_LOSS = ("a model that computes its own loss from the data file (a causal or masked language model: a data "
           "file holds no labels), or from Python symgraph.interpolate(a, b, lambdas, loss_fn)")


class LossPrograms:
    """The model's own program for each shape of batch, traced on ``meta`` with ``labels =
    input_ids`` for a model with an output embedding, so that it computes its own loss; a model
    whose program returns no loss is refused (:data:`NO_LOSS`) when its first batch is seen."""

    def __init__(self, model):
        self.model, self.programs = model, {}
        self.lm = callable(getattr(model, "get_output_embeddings", None)) and model.get_output_embeddings() is not None

    def inputs(self, batch) -> dict:
        """``batch`` with the labels the model's own loss needs."""
        return dict(batch) | ({"labels": batch["input_ids"]} if self.lm and "labels" not in batch else {})

    def __call__(self, batch):
        """``(program, inputs)`` for ``batch``: an ExportedProgram whose outputs hold a scalar loss."""
        from ..passes.trace import trace
        kw = self.inputs(batch)
        key = tuple((k, tuple(v.shape)) for k, v in sorted(kw.items()))
        if key not in self.programs:
            meta = {k: torch.zeros(v.shape, dtype=v.dtype, device="meta") for k, v in kw.items()}
            ep = trace(self.model, meta)[0]
            outs = ep.graph.output_node().args[0]
            vals = [getattr(o, "meta", {}).get("val") for o in outs] if isinstance(outs, (list, tuple)) else []
            if not any(isinstance(v, torch.Tensor) and v.dim() == 0 and v.is_floating_point() for v in vals):
                raise InputError(f"barrier needs a loss, and {type(self.model).__name__} computes none from its "
                                 f"inputs {', '.join(map(repr, batch))} alone (language models do: labels = "
                                 f"input_ids); expected {NO_LOSS}")
            self.programs[key] = ep
        return self.programs[key], kw


def streamed_curve(A, B, data, lambdas, al=None, programs: LossPrograms | None = None) -> list:
    """``[(λ, mean loss over data)]`` along ``λθ_A + (1−λ)θ_B′`` with nothing loaded whole:
    the model's own program (:class:`LossPrograms`, so it computes its own loss) runs op by op
    on tensors read from the checkpoints (:func:`interpolated_fetch`). Equals
    :func:`interpolate` with the model's own loss."""
    from ..alignment.graphrun import streamed_outputs
    from ..passes.trace import split_inputs
    programs = programs or LossPrograms(A.model)
    curve = []
    for lam in bar(lambdas, desc="barrier", unit="point"):
        fetch = interpolated_fetch(A, B, float(lam), al)
        total = 0.0
        for batch in data:
            program, kw = programs(batch)
            args, kwargs = split_inputs(A.model, kw)
            outs = streamed_outputs(program, args, kwargs, fetch)
            total += float(next(o for o in outs if isinstance(o, torch.Tensor) and o.dim() == 0))
        curve.append((float(lam), total / len(data)))
    return curve
