"""Learned matching's steps, written once for every way of computing the loss.

A start is chosen among solved alignments (:func:`choose_start`: the lowest mean loss of the
model halfway between A and B′ on the first :data:`START_BATCHES` batches), then
:func:`refine_elements` optimises its learnable elements (:func:`learnable`): each step draws
``λ ~ U(0.4, 0.6)`` (:func:`draw_lambda`, one seeded generator), takes batch ``step mod
len(data)``, lets the :class:`Objective` compute the loss of the model between A and B′ with
its gradient carried into the elements' parameters, and takes an Adam step; the elements are
then projected exactly onto their groups and :func:`summary` says what happened. How the loss
and gradient are computed is the objective's: in memory, the interpolated model's ``loss_fn``
(:class:`symgraph.alignment.refine.InMemory`); out of core, the anchor's traced graph run in
segments (:mod:`symgraph.merging.learned`). The Adam loop itself (:func:`optimise`) is also
learned rotations' (:mod:`symgraph.rotation.learned`), whose step takes no ``λ``.

Continuous classes are optimised on their group: rotations through
``torch.nn.utils.parametrizations.orthogonal`` (the orthogonal maps fixing 𝟙 as
``H diag(1, R) Hᵀ`` with ``R`` orthogonal), RoPE pair rotations by their angles. Unfibred
permutation classes use Git Re-Basin's straight-through estimator: a score matrix whose forward
value is its Hungarian projection and whose gradient passes straight through. Head
permutations, permutations inside heads and soft transport maps keep their solved values.
"""
from __future__ import annotations

import math
import sys
import time
from types import SimpleNamespace

import torch
from torch.nn.utils import parametrizations
from tqdm import tqdm

from .. import solve as S
from ..core.elements import Map, Perm
from ..core.groups import PERMUTATION_FAMILY, ones_basis, pair_rotations

__all__ = ["Objective", "learnable", "choose_start", "optimise", "refine_elements", "learned_matching",
           "draw_lambda", "summary", "START_BATCHES"]

#: Batches :func:`choose_start` evaluates each candidate start on.
START_BATCHES = 8


class Objective:
    """How learned matching computes its losses: a start's (:meth:`start_loss`) and a step's,
    with its gradient carried into the learnable elements' parameters (:meth:`step`), between
    :meth:`begin` and :meth:`end`. The elements are computed with where :meth:`working` puts
    them and kept where :meth:`stored` puts them (here: where they are)."""

    def start_loss(self, al, batches: list) -> float:
        """The mean loss on ``batches`` of the model halfway between A and B′ (``al``'s elements)."""
        raise NotImplementedError

    def begin(self, al, elements: dict, learn: dict) -> None:
        """Before the first step: ``elements`` (working) are ``al``'s, ``learn`` the learnable ones."""

    def step(self, live: dict, batch, lam: float) -> float:
        """One batch's loss of ``(1 − λ)·θ_A + λ·θ_B′``, B′ carried by the other elements and
        ``live`` (``{group id: learnable element}``), its gradient carried back through ``live``."""
        raise NotImplementedError

    def end(self) -> None:
        """After the last step (or a failed one)."""

    def working(self, elements: dict) -> dict:
        return elements

    def stored(self, elements: dict) -> dict:
        return elements


class _Learned(torch.nn.Module):
    """The trainable parametrisation of one class's element: on its group (a ``gl`` class's
    orthogonal part, a ``scaled_perm`` class's permutations)."""

    def __init__(self, g, E):
        super().__init__()
        self.kind = g.kind
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
            self.weight = torch.nn.Parameter(E.double().clone())
            parametrizations.orthogonal(self, "weight")
            with torch.no_grad():
                self.weight = E.double()  # right inverse: start at the solved element
            self.params = list(self.parameters())

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
        W = self.weight
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
        kind = g.kind
        if kind in PERMUTATION_FAMILY and (g.outer or not isinstance(E, (Perm, torch.Tensor))):
            continue
        if kind == "identity" or (kind in ("orthogonal", "gl") and isinstance(E, torch.Tensor)
                                  and not torch.allclose(E @ E.mT, torch.eye(E.shape[-1], dtype=E.dtype, device=E.device),
                                                         atol=1e-8)):
            continue
        out[g.id] = _Learned(g, E)
    return out


def draw_lambda(gen) -> float:
    """A step's weight of B′: ``λ ~ U(0.4, 0.6)`` from ``gen``."""
    return 0.4 + 0.2 * float(torch.rand((), generator=gen))


def summary(losses, steps: int, classes: int, seconds: float) -> dict:
    """What :func:`refine_elements` returns: ``steps``, ``classes``, ``loss_first``/``loss_last``
    (mean of the first/last 10% of the steps' losses), ``seconds``."""
    k = max(1, math.ceil(len(losses) / 10))
    return {"steps": steps, "classes": classes, "loss_first": sum(losses[:k]) / k,
            "loss_last": sum(losses[-k:]) / k, "seconds": seconds}


def choose_start(starts: dict, objective: Objective, data, batches: int = START_BATCHES):
    """The name of the alignment (of ``{name: Alignment}``) whose model halfway between A and
    B has the lowest mean loss on the first ``batches`` batches of ``data``, and every
    alignment's loss (``{name: loss}``)."""
    first = list(data)[:batches]
    losses = {name: objective.start_loss(al, first) for name, al in starts.items()}
    return min(losses, key=losses.__getitem__), losses


def optimise(learn: dict, step, data, steps: int, lr: float, *, desc: str = "refine",
             progress: bool = True) -> list:
    """The one step loop of learned matching and learned rotations: ``steps`` Adam steps of
    size ``lr`` on the parameters of ``learn`` (``{class id: its parametrisation}``,
    :func:`learnable`); step ``k`` calls ``step(live, data[k mod len(data)])``, ``live`` the
    learnable elements as functions of their parameters, which returns the batch's loss with
    its gradient carried back through ``live``. Returns the steps' losses."""
    opt = torch.optim.Adam([p for x in learn.values() for p in x.params], lr=lr)
    losses: list = []
    bar = tqdm(range(steps), desc=desc, unit="step", file=sys.stderr, leave=False,
               disable=None if progress else True)  # None: only on a terminal
    for k in bar:
        live = {gid: x.element() for gid, x in learn.items()}
        opt.zero_grad()
        losses.append(step(live, data[k % len(data)]))
        opt.step()
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
    return losses


def refine_elements(al, objective: Objective, data, steps: int, lr: float = 1e-3, seed: int = 0,
                    progress: bool = True) -> dict:
    """Optimise ``al``'s learnable elements in place for ``steps`` Adam steps of size ``lr``
    on batches of ``data`` (see the module docstring; :func:`optimise`, each step's ``λ`` drawn
    from a generator seeded by ``seed``); returns :func:`summary`'s record, or ``{"steps": 0,
    "classes": 0}`` when no element is learnable."""
    elements = objective.working(al.elements)
    learn = learnable(al.report_a, SimpleNamespace(elements=elements))
    if not learn:
        return {"steps": 0, "classes": 0}
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(seed)
    objective.begin(al, elements, learn)
    try:
        losses = optimise(learn, lambda live, batch: objective.step(live, batch, draw_lambda(gen)), data, steps,
                          lr, progress=progress)
    finally:
        objective.end()
    al.elements.update(objective.stored({gid: x.final() for gid, x in learn.items()}))
    return summary(losses, steps, len(learn), time.perf_counter() - t0)


def learned_matching(starts: dict, objective: Objective, data, steps: int, lr: float, t0: float,
                     progress: bool = True):
    """The alignment of ``starts`` (``{name: Alignment}``) :func:`choose_start` picks, refined
    (:func:`refine_elements`); ``t0``: when finding the starts began. Its ``refined`` record
    adds ``start`` (which) and ``start_loss`` (every start's loss); its ``seconds``, ``start``."""
    name, losses = choose_start(starts, objective, data)
    best = starts[name]
    best.seconds = {**starts[next(iter(starts))].seconds, "start": time.perf_counter() - t0}
    best.refined = refine_elements(best, objective, data, steps, lr, progress=progress)
    best.refined.update(start=name, start_loss=losses)
    return best

