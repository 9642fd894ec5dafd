"""The registry of merge methods.

A method is a class registered under a name with :func:`register`. It may collect a
statistic of each model on the data (in that model's own basis), say how that statistic moves
into the anchor's basis together with the weights, and combines the aligned weights::

    @register("average")
    class Average(MergeMethod):
        def combine(self, states, stats, weights, report):
            return {k: sum(w * s[k] for w, s in zip(weights, states)) for k in states[0]}

Files in ``symgraph/merging/`` are imported on first use, so a new method is one new file.
"""
from __future__ import annotations

from ..errors import InputError

__all__ = ["MergeMethod", "register", "get", "names"]

_METHODS: dict = {}


class MergeMethod:
    """Base class: plain weighted averaging needs no statistics."""
    name = "?"
    needs_data = False

    def statistics(self, model, report, data):
        """A statistic of ``model`` (in its own basis), or None."""
        return None

    def to_anchor(self, stat, alignment):
        """``stat`` moved into the anchor's basis by ``alignment`` (None: not aligned)."""
        return stat

    def combine(self, states, stats, weights, report) -> dict:
        """Merged ``{name: tensor}`` from the aligned ``states`` (float32, or float64 for
        float64 models; anchor's basis), their ``stats`` and the normalised mixing ``weights``; ``report`` is the
        anchor's."""
        raise NotImplementedError


def register(name: str):
    """Class decorator: make a :class:`MergeMethod` subclass available as ``method=name``."""
    def deco(cls):
        if not (isinstance(cls, type) and issubclass(cls, MergeMethod)):
            raise TypeError(f"@register({name!r}) expects a MergeMethod subclass, got {cls!r}")
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
        return method
    _discover()
    if method not in _METHODS:
        raise InputError(f"unknown method {method!r}; expected one of {tuple(_METHODS)}")
    try:
        return _METHODS[method](**kw)
    except TypeError as e:
        raise InputError(f"bad options {kw} for merge method {method!r}: {e}") from None


def _discover():
    import importlib
    import pkgutil

    pkg = importlib.import_module(__package__)
    for mod in pkgutil.iter_modules(pkg.__path__):
        importlib.import_module(f"{__package__}.{mod.name}")
