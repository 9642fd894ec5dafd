"""The registry of merge methods (how to write one: ``docs/merge.md``, "Methods").

A method is data: its typed **Parameters** (a pydantic model named ``Parameters``: the
constructor, YAML ``parameters:``, ``--parameter NAME=VALUE`` and the record
``symgraph_merge.json`` take them from it; each value an attribute, ``self.alpha``), the
**statistic** it needs of each model on the data (a kind of the engine's vocabulary,
:mod:`symgraph.merging.engine.statistics`; None: none) and how one tensor group **combines**
(``combine_group``, which finds each model's statistic, in the anchor's basis, in ``stats``),
registered under a name with :func:`register`. It never sees the merge engine, which reads its
declarations, takes the statistic, and calls ``combine_group`` one group (or slice of one) at
a time. Files in ``symgraph/merging/methods/`` are imported on first use, so a new method is
one new file.
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
        """Whether each statistic has its tensor's shape (squared gradients: a slice reads its
        slice), not another (a Gram over a weight's inputs: read whole)."""
        return getattr(self.statistic, "elementwise", True)

    @classmethod
    def parameters(cls) -> dict:
        """The method's parameters and their defaults, as its ``Parameters`` declares them."""
        return {k: f.default for k, f in cls.Parameters.model_fields.items()}

    def sliceable(self, name: str, dim: int, report) -> bool:
        """Whether tensor ``name`` may be merged in slices along ``dim`` (an axis no map acts on)."""
        return True

    def held_bytes(self, name: str, shape: tuple, item: int, n: int, report) -> int:
        """Bytes held while tensor ``name`` of ``shape`` (or a slice's) is combined from ``n``
        models, ``item`` bytes an element: each model's copy, the result and the statistics."""
        stats = n if self.needs_data and self.elementwise_statistics else 0
        return (n + 1 + stats) * item * math.prod(shape)

    def combine_group(self, names, values, stats, weights, report) -> dict:
        """Merged ``{name: tensor}`` of ``names`` (a norm fold's members, one tensor, or a slice
        of them) from each model's ``values`` (``{name: tensor}`` in the anchor's basis, in the
        work dtype), their ``stats`` (mappings, or None) and the normalised mixing ``weights``;
        ``report`` is the anchor's (None without alignment)."""
        raise InputError(f"merge method {self.name!r} ({type(self).__name__}) defines no combine_group; "
                         "expected combine_group(names, values, stats, weights, report), which the merge "
                         "engine calls for each group of tensors (in memory and out of core alike)")


def register(name: str):
    """Class decorator: make a :class:`MergeMethod` subclass available as ``method=name``."""
    if not isinstance(name, str) or not name.strip():
        raise InputError(f"register({name!r}): expected a method's name, a non-empty string")

    def deco(cls):
        if not (isinstance(cls, type) and issubclass(cls, MergeMethod)):
            raise TypeError(f"@register({name!r}) expects a MergeMethod subclass, got {cls!r}")
        check_kind(cls.statistic)
        if not cls.__module__.startswith(f"{__package__}."):  # a user's: the built-ins first, their names taken
            _discover()
        old = _METHODS.get(name)
        if old is not None and (old.__module__, old.__qualname__) != (cls.__module__, cls.__qualname__):
            raise InputError(f"merge method {name!r} is registered already ({old.__module__}.{old.__qualname__}); "
                             "expected a new name")
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
        f = cls.Parameters.model_fields.get(key)
        words = "(a valid value)" if f is None else f"({f.description or 'see the method'}; default {f.default!r})"
        raise InputError(f"merge method {cls.name!r} parameter {key!r} is {short_repr(given.get(key))} "
                         f"({why}); expected {key} {words}") from None


_FOUND: list = []  # set once the built-in methods' modules are imported


def _discover():
    import importlib
    import pkgutil

    if _FOUND:
        return
    _FOUND.append(True)
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
