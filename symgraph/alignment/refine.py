"""Learned matching: optimise solved elements so the interpolated model has low loss.

Starting from :func:`symgraph.align`'s elements (by activations or by weights alone,
whichever gives the lower midpoint loss on the data: :func:`choose_start`), each step draws ``λ ~ U(0.4, 0.6)``, carries
B into A's basis with the current elements, and takes a gradient step on the loss of
``(1 − λ)·θ_A + λ·θ_B′`` on one batch. Continuous classes are optimised on their group:
rotations through ``torch.nn.utils.parametrizations.orthogonal`` (the orthogonal maps fixing
𝟙 as ``H diag(1, R) Hᵀ`` with ``R`` orthogonal), RoPE pair rotations by their angles.
Unfibred permutation classes use Git Re-Basin's straight-through estimator: a score matrix
whose forward value is its Hungarian projection and whose gradient passes straight through.
Head permutations, permutations inside heads and soft transport maps keep their solved
values. The result is projected back onto the groups exactly, so it is still a symmetry of B.
Memory: about one extra copy of the parameters (B′), plus the score matrices of the
permutation classes.
"""
from __future__ import annotations

import contextlib
import math
import sys
import time

import torch
from torch.nn.utils import parametrizations
from tqdm import tqdm

from .. import solve as S
from ..transform.apply import move
from ..core.elements import Map, Perm
from ..errors import InputError
from ..core.groups import PERMUTATION_FAMILY, ones_basis, orthogonal_part, pair_rotations

__all__ = ["refine", "default_loss", "choose_start", "linear", "Bound", "learnable", "has_lm_head", "with_labels",
           "draw_lambda", "summary"]

#: Batches :func:`choose_start` evaluates each candidate start on.
START_BATCHES = 8


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
        kw["labels"] = kw["input_ids"]
    return kw


def has_lm_head(model) -> bool:
    """Whether ``model`` has an output embedding (a language model's head)."""
    get = getattr(model, "get_output_embeddings", None)
    return callable(get) and get() is not None


class _Holder(torch.nn.Module):
    def __init__(self, W):
        super().__init__()
        self.weight = torch.nn.Parameter(W.clone())


class _Learned:
    """The trainable parametrisation of one class's element."""

    def __init__(self, g, E):
        self.kind = orthogonal_part(g.kind)
        self.H = None
        if self.kind in PERMUTATION_FAMILY:
            P = E.dense() if isinstance(E, Perm) else E
            self.score = torch.nn.Parameter(P.clone().double())
            self.params = [self.score]
        elif self.kind == "rope":
            self.pairs, self.base = g.pairs, E.clone()
            i, j = (torch.tensor(x, dtype=torch.long).to(E.device) for x in zip(*g.pairs))
            self.theta = torch.nn.Parameter(torch.atan2(E[..., j, i], E[..., i, i]).clone())
            self.params = [self.theta]
        else:  # orthogonal, orthogonal_mean, gl (its orthogonal part, where solved so)
            if self.kind == "orthogonal_mean":
                self.H = ones_basis(E.shape[-1], device=E.device)
                E = (self.H.mT @ E @ self.H)[..., 1:, 1:]
            self.mod = _Holder(E.double())
            parametrizations.orthogonal(self.mod, "weight")
            with torch.no_grad():
                self.mod.weight = E.double()  # right inverse: start at the solved element
            self.params = list(self.mod.parameters())

    def _project(self, score):
        """The nearest element of the (signed) permutation group (a straight-through target)."""
        if self.kind == "signed_perm":
            return S.signed_hungarian(score).element
        return S.hungarian(score).element

    def element(self):
        if self.kind in PERMUTATION_FAMILY:
            with torch.no_grad():
                hard = self._project(self.score.detach()).to(self.score)
            return hard + self.score - self.score.detach()
        if self.kind == "rope":
            return pair_rotations(self.base, self.pairs, torch.cos(self.theta), torch.sin(self.theta))
        W = self.mod.weight
        if self.H is None:
            return W
        n = self.H.shape[0]
        inner = torch.zeros(*W.shape[:-2], n, n, dtype=W.dtype, device=W.device)
        inner[..., 0, 0] = 1
        inner[..., 1:, 1:] = W
        return self.H @ inner @ self.H.mT

    def final(self):
        """The element projected exactly onto the group."""
        with torch.no_grad():
            if self.kind in PERMUTATION_FAMILY:
                P = self._project(self.score)
                return P if self.kind == "signed_perm" else Perm.from_matrix(P)
            E = self.element().detach()
            if self.kind == "rope":
                return E
            U, _, Vh = torch.linalg.svd(E)
            return U @ Vh


def learnable(report, al) -> dict:
    """``{class id: its trainable parametrisation}`` for the classes of ``report`` whose
    element in ``al`` learned matching optimises (unfibred permutations, rotations, RoPE
    angles; not heads, soft maps or fixed classes)."""
    heads = {o for g in report.groups for o in g.outer}
    out = {}
    for g in report.groups:
        E = al.elements.get(g.id)
        if E is None or isinstance(E, Map) or g.id in heads:
            continue
        kind = orthogonal_part(g.kind)
        if kind in PERMUTATION_FAMILY and (g.outer or not isinstance(E, (Perm, torch.Tensor))):
            continue
        if kind == "identity" or (kind == "orthogonal" and isinstance(E, torch.Tensor)
                                  and not torch.allclose(E @ E.mT, torch.eye(E.shape[-1], dtype=E.dtype, device=E.device),
                                                         atol=1e-8)):
            continue
        out[g.id] = _Learned(g, E)
    return out


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
    loss_fn = loss_fn or default_loss
    learn = learnable(al.report_a, al)
    if not learn:
        return {"steps": 0, "classes": 0}
    t0 = time.perf_counter()
    between = between or linear(model_a)
    ta, tb = _values(al, model_a, model_b)
    opt = torch.optim.Adam([p for x in learn.values() for p in x.params], lr=lr)
    gen = torch.Generator().manual_seed(seed)
    losses = []
    bar = tqdm(range(steps), desc="refine", unit="step", file=sys.stderr, leave=False,
               disable=None if progress else True)  # None: only on a terminal
    with _evaluating(model_a):
        for step in bar:
            batch = data[step % len(data)]
            lam = draw_lambda(gen)
            els = dict(al.elements)
            els.update({gid: x.element() for gid, x in learn.items()})
            loss = _call(loss_fn, between(ta, _carried(al, ta, tb, els), lam), batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{losses[-1]:.4f}")
    for gid, x in learn.items():
        al.elements[gid] = x.final()
    return summary(losses, steps, len(learn), time.perf_counter() - t0)


def draw_lambda(gen) -> float:
    """A step's weight of B′: ``λ ~ U(0.4, 0.6)`` from ``gen``."""
    return 0.4 + 0.2 * float(torch.rand((), generator=gen))


def summary(losses, steps: int, classes: int, seconds: float) -> dict:
    """What :func:`refine` returns: ``steps``, ``classes``, ``loss_first``/``loss_last`` (mean
    of the first/last 10% of the steps' losses), ``seconds``."""
    k = max(1, math.ceil(len(losses) / 10))
    return {"steps": steps, "classes": classes, "loss_first": sum(losses[:k]) / k,
            "loss_last": sum(losses[-k:]) / k, "seconds": seconds}


def choose_start(alignments: dict, model_a, model_b, data, loss_fn=None, batches: int = START_BATCHES,
                 between=None):
    """The name of the alignment (of ``{name: Alignment}``) whose model halfway between A and
    B has the lowest mean loss on the first ``batches`` batches of ``data``, and every
    alignment's loss (``{name: loss}``)."""
    loss_fn, between = loss_fn or default_loss, between or linear(model_a)
    ta, tb = _values(next(iter(alignments.values())), model_a, model_b)
    losses = {}
    with _evaluating(model_a), torch.no_grad():
        for name, al in alignments.items():
            model = between(ta, _carried(al, ta, tb, al.elements), 0.5)
            got = [float(_call(loss_fn, model, b)) for b in list(data)[:batches]]
            losses[name] = sum(got) / len(got)
    return min(losses, key=losses.__getitem__), losses


@contextlib.contextmanager
def _evaluating(model):
    """``model`` in eval mode (no dropout) for the block; its own mode restored after."""
    was = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was)


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
