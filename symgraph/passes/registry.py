"""Constraint algebra and the rule table.

A rule is a pure function ``rule(ctx) -> list[Constraint]``: it reads the node's input and
output axes from ``ctx`` (a :class:`RuleContext`) and states how they relate. Rules never
touch the graph or the union-find; :mod:`symgraph.passes.unionfind` consumes what they say.
Rules are registered per ATen overload (or overload packet) with :func:`register`.
``register(..., observe=...)`` also marks ops whose output is a good *observation point* for
activation matching (a linear map, a norm, a nonlinearity, attention, a sum or product, a
concatenation): alignment from activations reads a class's coordinates there.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from ..core.groups import GroupKind
from .nodes import packet as _packet

__all__ = ['Unify', 'Meet', 'Structure', 'NoFiber', 'Rope', 'Label', 'register', 'observed', 'lookup', 'has_rule', 'RuleContext', 'broadcast', 'dim']


@dataclass(frozen=True)
class Unify:
    """Axes ``a`` and ``b`` transform together; with ``dual`` b takes ``g^{-T}`` where a takes ``g``."""
    a: int
    b: int
    dual: bool = False


@dataclass(frozen=True)
class Meet:
    """Narrow the group of ``axis``'s class to (its meet with) ``kind``; ``reason`` says why."""
    axis: int
    kind: GroupKind
    reason: str


@dataclass(frozen=True)
class Structure:
    """``axis`` is a product (row-major flatten) or direct sum (concatenation) of ``parts``."""
    axis: int
    kind: str  # "prod" | "sum"
    parts: tuple


@dataclass(frozen=True)
class NoFiber:
    """Elements of ``axis``'s class may not vary along ``over``'s class (they are mixed there);
    ``reason`` says why, where the op alone does not."""
    axis: int
    over: int
    reason: str = ""


@dataclass(frozen=True)
class Rope:
    """``axis`` carries rotary position embeddings rotating the coordinate ``pairs``."""
    axis: int
    pairs: tuple


@dataclass(frozen=True)
class Label:
    """The *values* of output ``out`` (its index in a tuple output; None for a single tensor)
    are coordinates of ``axis``'s class, which has ``size`` entries (top-k's indices over the
    experts: which expert each token goes to). See :mod:`symgraph.passes.labels`."""
    out: int | None
    axis: int
    size: int


Constraint = Unify | Meet | Structure | NoFiber | Rope | Label

_RULES: dict = {}
_OBSERVED: set = set()  # op packets whose outputs are observation points




def register(ops, observe=False) -> Callable:
    """Register a rule for one ATen overload/packet or a list of them.

    ``observe``: True marks every op of the list (all overloads of its packet) as an
    observation point for activation matching; a list marks only those ops.
    """
    if not isinstance(ops, (list, tuple)):
        ops = [ops]
    seen = ops if observe is True else (observe or ())
    _OBSERVED.update(_packet(op) for op in seen)

    def deco(fn):
        for op in ops:
            old = _RULES.get(op)  # a rule for one overload may refine its packet's rule
            if old is not None and old is not fn:
                raise ValueError(f"a rule for {op} is already registered ({old.__module__}.{old.__qualname__}); "
                                 f"expected one rule per op: remove it with unregister({op}) first")
        for op in ops:
            _RULES[op] = fn
        return fn

    return deco


def unregister(op) -> None:
    """Remove the rule registered for ``op`` (an overload or packet), if any."""
    _RULES.pop(op, None)


def observed(target) -> bool:
    """Whether ``target``'s output is an observation point (see :func:`register`)."""
    return _packet(target) in _OBSERVED


def lookup(target):
    """The rule for ``target`` (an OpOverload, its packet, or a Python callable), or None."""
    rule = _RULES.get(target)
    if rule is None and isinstance(target, torch._ops.OpOverload):
        rule = _RULES.get(target.overloadpacket)
    return rule


def has_rule(target) -> bool:
    return lookup(target) is not None


class RuleContext:
    """What a rule sees of one node: its arguments and their axis ids."""

    def __init__(self, node, axes_of, kind_of, new_axis, label_of=None, constant_of=None):
        self.node = node
        self._axes_of = axes_of
        self._kind_of = kind_of
        self._new_axis = new_axis
        self._label_of = label_of
        self._constant_of = constant_of

    # --- arguments -------------------------------------------------------------------
    @property
    def args(self):
        return self.node.args

    def arg(self, i, name=None, default=None):
        if i < len(self.node.args):
            return self.node.args[i]
        if name is not None and name in self.node.kwargs:
            return self.node.kwargs[name]
        return default

    def axes(self, value):
        """Axis ids of a tensor argument (an fx Node), or None for non-tensors."""
        if isinstance(value, torch.fx.Node):
            return self._axes_of(value)
        return None

    def shape(self, value):
        if isinstance(value, torch.fx.Node):
            v = value.meta.get("val")
            if isinstance(v, torch.Tensor):
                return tuple(int(s) for s in v.shape)
        return None

    def origin(self, value):
        """'param', 'const' or 'act' for a tensor argument; 'scalar' for anything else."""
        if isinstance(value, torch.fx.Node):
            return self._kind_of(value)
        return "scalar"

    def label(self, value):
        """``(axis, size)`` when the values of tensor argument ``value`` are coordinates of
        ``axis``'s class (a :class:`Label`), else None."""
        if isinstance(value, torch.fx.Node) and self._label_of is not None:
            return self._label_of(value)
        return None

    def constant(self, value):
        """The values of a tensor argument that is a constant of the program (a literal the
        model's code wrote, lifted by export), else None."""
        if isinstance(value, torch.fx.Node) and self._constant_of is not None:
            return self._constant_of(value)
        return None

    @property
    def out(self):
        return self._axes_of(self.node)

    @property
    def out_shape(self):
        return self.shape(self.node)

    def new_axis(self, size: int) -> int:
        return self._new_axis(size)

    @property
    def where(self) -> str:
        return self.node.name


# --- helpers shared by several rule files ------------------------------------------------

def broadcast(out_axes, out_shape, operands: Iterable, ctx: RuleContext, on_broadcast=None):
    """Right-aligned broadcasting: unify each operand axis with the output axis it feeds.

    Operand axes of size 1 against a larger output axis are broadcasts; ``on_broadcast`` (a
    kind or None) is met on such output axes. Yields constraints.
    """
    out: list[Constraint] = []
    for v in operands:
        axes, shape = ctx.axes(v), ctx.shape(v)
        if axes is None:
            continue
        offset = len(out_axes) - len(axes)
        for k, (a, s) in enumerate(zip(axes, shape)):
            o = offset + k
            if s == out_shape[o]:
                out.append(Unify(out_axes[o], a))
            elif s == 1 and on_broadcast is not None and out_shape[o] > 1:
                out.append(Meet(out_axes[o], on_broadcast, f"{ctx.where}: broadcast operand"))
        if on_broadcast is not None:
            for o in range(offset):  # operand lacks these leading axes entirely
                if out_shape[o] > 1:
                    out.append(Meet(out_axes[o], on_broadcast, f"{ctx.where}: broadcast operand"))
    return out


def dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d
