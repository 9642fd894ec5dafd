"""The statistics a merge method may ask for, from a small vocabulary the engine takes out of core.

A method never sees the engine: it declares the **kind** of statistic it needs as a class
attribute (``statistic = InputGrams()``; None: none) and receives, in its ``combine_group``, each
model's statistic in the anchor's basis as a mapping ``name -> tensor``. The engine takes a kind
with :func:`take` from a :class:`StatisticsContext` (what it knows once the alignment is known:
the checkpoints, alignments, data, device, budget, ledger and spill), never from itself.

* :class:`InputGrams` — per linear weight, ``Σ x xᵀ`` (float64) of its input over the data
  (RegMean's), by the op-by-op run of the anchor's graph on each model carried into the
  anchor's basis (:func:`~symgraph.merging.engine.sums.input_grams`); in a model's own basis a
  Gram moves as ``M G Mᵀ`` (a permutation: ``G[p][:, p]``).
* :class:`SquaredGradients` — per parameter, ``Σ_batches (∂ loss / ∂ w)²`` of a declared
  function of the logits (Fisher's), the graph differentiated segment by segment
  (:func:`~symgraph.merging.engine.gradients.squared_gradients`); it moves with the squared map
  ``M ⊙ M``.

A new kind is one frozen dataclass and one taker registered for its class with
:func:`takes` (its budget floor with it, where it has one)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from ...errors import InputError
from ...transform.apply import map_parameters
from .gradients import budget_floor, squared_gradients
from .sums import Stored, input_grams

__all__ = ["InputGrams", "SquaredGradients", "StatisticsContext", "Taker", "TAKERS", "takes", "take", "floor",
           "check_kind"]


@dataclass(frozen=True)
class InputGrams:
    """Sums of ``XᵀX`` at each linear weight's input, float64, one per input node (the weights
    that read one input share its Gram). A Gram is over the weight's inputs, not of its shape:
    a slice of the weight reads it whole."""
    elementwise: ClassVar[bool] = False

    @staticmethod
    def to_anchor(grams: dict, alignment) -> dict:
        """``grams`` of a model in its own basis moved into the anchor's by ``alignment`` (None:
        as they are): ``M G Mᵀ`` per linear weight, ``M`` the alignment's map of its input axis."""
        if alignment is None:
            return grams
        rb, out = alignment.report_b, {}
        for w, _, axis, _ in rb.linear_layers():
            if w not in grams:
                continue
            M, G = rb.axis_map(axis, alignment.elements), grams[w]
            out[w] = G if M is None else G[M][:, M] if M.dim() == 1 else M @ G @ M.T
        return out


@dataclass(frozen=True)
class SquaredGradients:
    """Sums over batches of each parameter's squared gradient of ``loss`` (a function of the
    graph's first output, the logits, to a scalar), of the parameter's own shape."""
    loss: Callable
    elementwise: ClassVar[bool] = True

    @staticmethod
    def to_anchor(stat: dict, alignment) -> dict:
        """``stat`` of a model in its own basis moved into the anchor's by ``alignment`` (None: as
        it is): each map applied squared (``M ⊙ M``) along every axis it acts on."""
        if alignment is None:
            return stat
        rb = alignment.report_b
        mine = {k: v for k, v in stat.items() if k in set(rb.parameters)}
        return {**stat, **map_parameters(rb, alignment.elements, mine, squared=True)}


@dataclass(frozen=True)
class StatisticsContext:
    """What a taker reads: the checkpoints ``ckpts`` (``anchor`` the index of the one whose
    basis the statistics are taken in), one alignment per checkpoint (None: not moved), the
    anchor's analysis ``graph_report`` (the graph the data runs through), the ``data`` (a list
    of batches), the merge's :class:`~.executor.Resources` (device, work dtype, the bytes of each
    model's cache and of a pass of statistics, the ledger of bytes held) and the ``spill`` the
    statistics are written to (None before the statistics step: enough for :func:`floor`)."""
    ckpts: tuple
    alignments: tuple
    anchor: int
    graph_report: Any
    data: Any
    resources: Any
    spill: Any = None

    @classmethod
    def of(cls, job) -> StatisticsContext:
        """The context of the merge engine ``job`` as it stands."""
        return cls(tuple(job.checkpoints), tuple(job.alignments), job.anchor, job.graph_report, job.data, job.resources,
                   job.spill)


@dataclass(frozen=True)
class Taker:
    """How the engine takes one kind: ``take(kind, context, i) -> Stored`` (model ``i``'s
    statistic in the anchor's basis, spilled) and ``floor(kind, context) -> (bytes, what)``,
    the smallest budget it fits in and what needs it (a phrase), or ``(0, None)``."""
    take: Callable
    floor: Callable | None = None


#: kind class -> its :class:`Taker`
TAKERS: dict[type, Taker] = {}


def takes(kind: type, floor: Callable | None = None):
    """Decorator: the function is how the engine takes statistics of class ``kind`` (and
    ``floor`` its budget floor)."""
    def deco(fn):
        TAKERS[kind] = Taker(fn, floor)
        return fn
    return deco


def check_kind(kind) -> None:
    """Refuse a declared statistic the engine cannot take (not None nor a registered kind)."""
    if kind is not None and type(kind) not in TAKERS:
        raise InputError(f"a merge method declares statistic={kind!r}, which the merge engine cannot take; "
                         f"expected None or one of {', '.join(k.__name__ for k in TAKERS)}")


def take(kind, context: StatisticsContext, i: int) -> Stored | None:
    """Model ``i``'s statistic of ``kind`` in the anchor's basis (read when asked for), taken
    within the context's budget and written to its spill; None for ``kind`` None."""
    check_kind(kind)
    return None if kind is None else TAKERS[type(kind)].take(kind, context, i)


def floor(kind, context: StatisticsContext) -> tuple:
    """``(bytes, what)``: the smallest memory budget statistics of ``kind`` are taken in, known
    before any alignment, and what needs it; ``(0, None)`` where any budget will do."""
    check_kind(kind)
    rule = None if kind is None else TAKERS[type(kind)].floor
    return (0, None) if rule is None else rule(kind, context)


@takes(InputGrams)
def _input_grams(kind: InputGrams, context: StatisticsContext, i: int) -> Stored:
    return input_grams(context, i, f"grams/{i}/")


def _gradients_floor(kind: SquaredGradients, context: StatisticsContext) -> tuple:
    need, weight = budget_floor(context)
    return need, f"its squared gradients' largest op (reading {weight!r}), with the values kept at the cuts"


@takes(SquaredGradients, floor=_gradients_floor)
def _squared_gradients(kind: SquaredGradients, context: StatisticsContext, i: int) -> Stored:
    return squared_gradients(context, i, kind, f"gradients/{i}/")
