"""The registry of merge methods.

A method is data: its typed **Parameters**, the **statistic** it needs of each model on the
data (None: none), and how one tensor group **combines** (``combine_group``). It is a class
registered under a name with :func:`register`, and it never sees the merge engine: the
engine reads its declarations, takes the statistic, and calls ``combine_group`` one group (or
one slice of a group) at a time, in memory and out of core alike::

    @register("average")
    class Average(MergeMethod):
        statistic = None
        def combine_group(self, names, values, stats, weights, report):
            return {k: sum(w * v[k] for w, v in zip(weights, values)) for k in names}

A method that needs data declares one kind of the engine's vocabulary
(:mod:`symgraph.merging.engine.statistics`) and finds each model's statistic, in the
anchor's basis, in ``stats`` (one mapping ``name -> tensor`` per model)::

    class Grams(Average):
        statistic = InputGrams()                      # Σ xᵀx at each linear weight's input
    class Squared(Average):
        statistic = SquaredGradients(loss=my_loss)    # Σ (∂ my_loss(logits) / ∂ w)²

``needs_data`` follows (``statistic is not None``). A method with parameters declares them
once, as a pydantic model named ``Parameters`` (types, ranges, defaults, descriptions): the
constructor, YAML ``parameters:`` (mergekit's key), the ``--parameter NAME=VALUE`` flag and the
record ``symgraph_merge.json`` all take them from it, and each validated value is an attribute
of the instance (``self.alpha``)::

    class Parameters(MethodParameters):
        alpha: float = Field(0.9, ge=0, le=1, description="...")

Files in ``symgraph/merging/methods/`` are imported on first use, so a new method is one new file.
"""
from __future__ import annotations

import math
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationError

from ...core.schema import short_repr
from ...errors import InputError
from ..engine.statistics import check_kind

__all__ = ["MergeMethod", "MethodParameters", "register", "get", "names", "mixing_weights", "describe_parameters"]

_METHODS: dict = {}


class MethodParameters(BaseModel):
    """A method's typed parameters (a subclass declares them as fields; this one has none):
    frozen, unknown names refused, values strictly of their type (``true`` is no number)."""
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class MergeMethod:
    """Base class: plain weighted averaging needs no statistics."""
    name = "?"
    #: The statistic of each model the method's combine reads, a kind of the engine's
    #: vocabulary (:mod:`symgraph.merging.engine.statistics`), or None: none.
    statistic: ClassVar[Any] = None
    #: The method's parameters (see the module docstring); validated by the constructor.
    Parameters: type[MethodParameters] = MethodParameters

    def __init__(self, **parameters):
        self.params = validate_parameters(type(self), parameters)
        for k, v in self.params.model_dump().items():  # each value an attribute (self.alpha)
            setattr(self, k, v)

    @property
    def needs_data(self) -> bool:
        """Whether the method takes a statistic on the data (it declares one)."""
        return self.statistic is not None

    @property
    def elementwise_statistics(self) -> bool:
        """Whether each statistic has its tensor's own shape, element for element (squared
        gradients): a slice of the tensor then reads only that slice of its statistic. False
        for statistics of another shape (a Gram over a weight's inputs): read whole."""
        return getattr(self.statistic, "elementwise", True)

    @classmethod
    def parameters(cls) -> dict:
        """The method's parameters and their defaults, as its ``Parameters`` declares them."""
        return {k: f.default for k, f in cls.Parameters.model_fields.items()}

    def sliceable(self, name: str, dim: int, report) -> bool:
        """Whether tensor ``name`` may be merged in slices along ``dim`` (the engine slices
        large tensors along an axis no map acts on; each slice's statistics are the same slice
        of the whole tensor's)."""
        return True

    def held_bytes(self, name: str, shape: tuple, item: int, n: int, report) -> int:
        """Bytes the engine holds while it combines tensor ``name`` of ``shape`` (a slice's, when
        it slices it) from ``n`` models, ``item`` bytes an element in the work dtype: each model's
        copy and the result, and the statistics read for it (of the tensor's own shape where the
        method takes data)."""
        stats = n if self.needs_data and self.elementwise_statistics else 0
        return (n + 1 + stats) * item * math.prod(shape)

    def combine_group(self, names, values, stats, weights, report) -> dict:
        """Merged ``{name: tensor}`` of the tensors ``names`` (a unit the engine computes
        together: a norm fold's members, or one tensor, or a slice of them along an axis no map
        acts on) from each model's ``values`` (a list of ``{name: tensor}`` in the anchor's basis,
        float32, or float64 for float64 models), their ``stats`` (mappings, or None) and the
        normalised mixing ``weights``; ``report`` is the anchor's (None without alignment)."""
        raise InputError(f"merge method {self.name!r} ({type(self).__name__}) defines no combine_group; "
                         "expected combine_group(names, values, stats, weights, report), which the merge "
                         "engine calls for each group of tensors (in memory and out of core alike)")

    def combine(self, states, stats, weights, report) -> dict:
        """Merged ``{name: tensor}`` of whole aligned ``states``: :meth:`combine_group` over
        every name (what :func:`symgraph.merge` calls with models in memory)."""
        return self.combine_group(list(states[0]), states, stats, weights, report)


def register(name: str):
    """Class decorator: make a :class:`MergeMethod` subclass available as ``method=name``."""
    def deco(cls):
        if not (isinstance(cls, type) and issubclass(cls, MergeMethod)):
            raise TypeError(f"@register({name!r}) expects a MergeMethod subclass, got {cls!r}")
        check_kind(cls.statistic)
        cls.name = name
        _METHODS[name] = cls
        return cls
    return deco


def names() -> tuple:
    _discover()
    return tuple(_METHODS)


def get(method, **kw) -> MergeMethod:
    """A method instance from a registered name (``kw`` to its constructor) or an instance."""
    if isinstance(method, MergeMethod):
        check_kind(method.statistic)
        return method
    _discover()
    if method not in _METHODS:
        raise InputError(f"unknown method {method!r}; expected one of {tuple(_METHODS)}")
    return _METHODS[method](**kw)


def describe_parameters(cls) -> str:
    """The parameters of method class ``cls`` in words: ``alpha (a number in [0, 1], default
    0.9: ...)``, or that it takes none."""
    fields = cls.Parameters.model_fields
    if not fields:
        return f"no parameters (method {cls.name!r} takes none)"
    return "; ".join(f"{k} (default {f.default!r}: {f.description or 'see the method'})" for k, f in fields.items())


def validate_parameters(cls, given) -> MethodParameters:
    """``given`` (a mapping of parameter names to values) validated by method class ``cls``'s
    ``Parameters``, or refused in one line naming the method's parameters."""
    if not isinstance(given, dict):
        raise InputError(f"parameters of merge method {cls.name!r} are {short_repr(given)} "
                         f"({type(given).__name__}); expected a mapping of {describe_parameters(cls)}")
    unknown = sorted(map(str, set(given) - set(cls.Parameters.model_fields)))
    if unknown:
        raise InputError(f"merge method {cls.name!r} has no parameter {unknown[0]!r}; expected "
                         f"{describe_parameters(cls)}")
    try:
        return cls.Parameters.model_validate(given)
    except ValidationError as e:
        err = e.errors()[0]
        key = str(err["loc"][0]) if err.get("loc") else "?"
        why = str(err.get("msg", "")).removeprefix("Value error, ")
        raise InputError(f"merge method {cls.name!r} parameter {key!r} is {short_repr(given.get(key))} "
                         f"({why}); expected {key} {_field_words(cls.Parameters.model_fields.get(key))}") from None


def _field_words(f) -> str:
    """A parameter's declaration in words: its description and default."""
    return "(a valid value)" if f is None else f"({f.description or 'see the method'}; default {f.default!r})"


def _discover():
    import importlib
    import pkgutil

    pkg = importlib.import_module(__package__)
    for mod in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{__package__}.{mod.name}")


def mixing_weights(weights, n: int):
    """``weights`` (None: uniform) as ``n`` non-negative numbers normalised to sum 1, refused
    unless finite with a positive sum. Scaled by their largest value first, so huge weights
    (``1e308``) do not overflow the sum."""
    import numpy as np
    w = np.ones(n) if weights is None else np.asarray(weights, float)
    if w.ndim != 1 or w.shape[0] != n:
        raise InputError(f"weights has {w.size} values for {n} models ({weights!r}); expected one mixing "
                         "weight per model")
    if not np.isfinite(w).all() or (w < 0).any() or w.max() <= 0:
        raise InputError(f"weights must be {n} finite non-negative numbers with a positive sum, got "
                         f"{weights!r}; expected one mixing weight per model")
    w = w / w.max()
    return w / w.sum()
