"""Learned matching in memory: optimise solved elements so the interpolated model has low loss.

Starting from :func:`symgraph.align`'s elements (by activations or by weights alone,
whichever gives the lower midpoint loss on the data: :func:`choose_start`), each step draws ``λ ~ U(0.4, 0.6)``, carries
B into A's basis with the current elements, and takes a gradient step on the loss of
``(1 − λ)·θ_A + λ·θ_B′`` on one batch (:mod:`.learning`: the steps, the elements'
parametrisation on their groups and their exact projection back, whatever computes the loss;
here :class:`InMemory`, ``loss_fn`` on the interpolated model). The result is still a symmetry
of B. Memory: about one extra copy of the parameters (B′), plus the score matrices of the
permutation classes.
"""
from __future__ import annotations

import torch

from ..core.modes import set_mode
from ..passes.trace import eval_mode
from ..transform.apply import move
from ..errors import InputError
from .learning import START_BATCHES, Objective, draw_lambda, learnable, refine_elements, summary
from .learning import choose_start as _choose

__all__ = ["refine", "default_loss", "choose_start", "linear", "Bound", "learnable", "has_lm_head", "with_labels",
           "draw_lambda", "summary", "InMemory"]


def default_loss(model, batch, purpose: str = "refine", expected: str | None = None):
    """The model's own loss: ``model(**batch).loss``, with ``labels = input_ids`` added for a
    model with an output embedding (causal and masked LMs) when the batch has no labels. A model
    that computes none is refused in one line naming ``purpose``, what asked for the loss
    (``"refine"``, ``"barrier"``), and ``expected`` (default: batches with labels)."""
    if isinstance(batch, dict):
        out = model(**with_labels(model, batch))
        loss = getattr(out, "loss", None)
        if loss is not None:
            return loss
    name = getattr(model, "wrapped_name", type(model).__name__)
    given = f"its inputs {', '.join(map(repr, batch))}" if isinstance(batch, dict) else "its inputs"
    raise InputError(f"{purpose} needs a loss, and {name} computes none from {given} alone (language models do: "
                     "labels = input_ids); expected " + (expected or "batches with labels, or from Python "
                                                         "loss_fn(model, batch) -> scalar"))


def with_labels(model, batch: dict) -> dict:
    """``batch`` with ``labels = input_ids`` added for a model with an output embedding (causal
    and masked LMs) when it has no labels: what the model's own loss is computed from."""
    kw = dict(batch)
    if "labels" not in kw and "input_ids" in kw and has_lm_head(model):
        ids, dec = kw["input_ids"], kw.get("decoder_input_ids")
        if isinstance(dec, torch.Tensor) and isinstance(ids, torch.Tensor) and dec.shape != ids.shape:
            raise InputError(f"the model's loss needs labels: its decoder reads decoder_input_ids of shape "
                             f"{tuple(dec.shape)}, which input_ids {tuple(ids.shape)} cannot label; expected "
                             "'labels' (the decoder's target ids) in each batch")
        kw["labels"] = ids
    return kw


def has_lm_head(model) -> bool:
    """Whether ``model`` has an output embedding (a language model's head)."""
    get = getattr(model, "get_output_embeddings", None)
    return callable(get) and get() is not None


class Bound(torch.nn.Module):
    """Model A's module run on other parameter values (``loss_fn(model, batch)`` calls it)."""

    def __init__(self, model, values):
        super().__init__()
        self.model, self.values = model, values
        self.wrapped_name = type(model).__name__

    def forward(self, *args, **kwargs):
        return torch.func.functional_call(self.model, self.values, args, kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.model, name)


def refine(al, model_a, model_b, data, steps: int, loss_fn=None, lr: float = 1e-3,
           seed: int = 0, progress: bool = True, between=None) -> dict:
    """Optimise ``al``'s elements in place for ``steps`` steps; returns what happened
    (``steps``, ``loss_first``/``loss_last`` (mean of the first/last 10% of steps), ``classes``,
    ``seconds``). ``between(θ_A, θ_B′, λ) -> model`` is the model trained on (λ the weight
    of B′); default :func:`linear`, the interpolation in A's architecture."""
    if not data:
        raise InputError("refine needs data: an iterable of batches to compute the loss on")
    return refine_elements(al, InMemory(model_a, model_b, loss_fn, between), data, steps, lr, seed, progress)


def choose_start(alignments: dict, model_a, model_b, data, loss_fn=None, batches: int = START_BATCHES,
                 between=None):
    """The name of the alignment (of ``{name: Alignment}``) whose model halfway between A and
    B has the lowest mean loss on the first ``batches`` batches of ``data``, and every
    alignment's loss (``{name: loss}``)."""
    return _choose(alignments, InMemory(model_a, model_b, loss_fn, between), data, batches)


class InMemory(Objective):
    """Learned matching's loss in memory: ``loss_fn(between(θ_A, θ_B′, λ), batch)`` (default:
    the model's own loss, :func:`default_loss`; the interpolation run by A's module,
    :func:`linear`), differentiated by autograd through the whole model."""

    def __init__(self, model_a, model_b, loss_fn=None, between=None) -> None:
        self.model_a, self.model_b = model_a, model_b
        self.loss_fn, self.between = loss_fn or default_loss, between or linear(model_a)

    def start_loss(self, al, batches: list) -> float:
        ta, tb = _values(al, self.model_a, self.model_b)
        with eval_mode(self.model_a), torch.no_grad():
            model = self.between(ta, _carried(al, ta, tb, al.elements), 0.5)
            got = [float(_call(self.loss_fn, model, b)) for b in batches]
        return sum(got) / len(got)

    def begin(self, al, elements: dict, learn: dict) -> None:
        self.al, self.elements = al, dict(elements)
        self.ta, self.tb = _values(al, self.model_a, self.model_b)
        self.was = self.model_a.training
        set_mode(self.model_a, False)  # no dropout while learning; its own mode restored by end()

    def step(self, live: dict, batch, lam: float) -> float:
        els = {**self.elements, **live}
        loss = _call(self.loss_fn, self.between(self.ta, _carried(self.al, self.ta, self.tb, els), lam), batch)
        loss.backward()
        return loss.item()

    def end(self) -> None:
        set_mode(self.model_a, self.was)
        del self.ta, self.tb, self.al, self.elements


def _values(al, model_a, model_b):
    """A's parameters (tied names included) and B's parameters of the report (detached)."""
    ta = {k: p.detach() for k, p in model_a.named_parameters()}
    for keep, others in al.report_a.aliases.items():
        ta.update({o: ta[keep] for o in others if keep in ta})
    return ta, {k: model_b.get_parameter(k).detach() for k in al.report_b.parameters}


def _carried(al, ta, tb, elements) -> dict:
    """B's parameters carried into A's basis by ``elements``, for every parameter name of A
    (tied names included)."""
    moved = move(al.report_b, elements, tb, al.gauge or None)
    values = {}
    for k, a in ta.items():
        b = moved.get(k)
        values[k] = (tb.get(k, a) if b is None else b).to(a.dtype)
    for keep, others in al.report_a.aliases.items():
        values.update({o: values[keep] for o in others if keep in values})
    return values


def linear(model_a):
    """The default model between A and B′: ``(1 − λ)·θ_A + λ·θ_B′`` run by A's module."""
    def between(ta, tb, lam):
        out, done = {}, {}
        for k, a in ta.items():  # tied names share one tensor, as functional_call wants
            key = (id(a), id(tb[k]))
            out[k] = done[key] = done[key] if key in done else (1 - lam) * a + lam * tb[k]
        return Bound(model_a, out)
    return between


def _call(loss_fn, model, batch):
    loss = loss_fn(model, batch)
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
        raise InputError(f"loss_fn must return a scalar tensor, got {type(loss).__name__}")
    return loss
