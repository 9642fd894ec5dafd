"""The registry of merge methods.

A method is a class registered under a name with :func:`register`. It may collect a
statistic of each model on the data (in that model's own basis), say how that statistic moves
into the anchor's basis together with the weights, and combines the aligned weights::

    @register("average")
    class Average(MergeMethod):
        def combine_group(self, names, values, stats, weights, report):
            return {k: sum(w * v[k] for w, v in zip(weights, values)) for k in names}

Files in ``symgraph/merging/methods/`` are imported on first use, so a new method is one new file.
"""
from __future__ import annotations

from ...errors import InputError
from ..statistics import whole_model

__all__ = ["MergeMethod", "register", "get", "names", "mixing_weights"]

_METHODS: dict = {}


class MergeMethod:
    """Base class: plain weighted averaging needs no statistics."""
    name = "?"
    needs_data = False
    #: Whether each statistic has its tensor's own shape, element for element (Fisher's
    #: squared gradients): a slice of the tensor then reads only that slice of its statistic.
    #: False for statistics of another shape (RegMean's Gram over a weight's inputs, square
    #: like a square weight): read whole.
    elementwise_statistics = True

    @classmethod
    def parameters(cls) -> dict:
        """The method's parameters and their defaults, as its constructor declares them."""
        import inspect
        sig = inspect.signature(cls.__init__)
        return {k: p.default for k, p in sig.parameters.items()
                if k != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}

    def statistics(self, model, report, data):
        """A statistic of ``model`` (in its own basis), or None."""
        return None

    def to_anchor(self, stat, alignment):
        """``stat`` moved into the anchor's basis by ``alignment`` (None: not aligned)."""
        return stat

    def streamed_statistics(self, job, i: int):
        """Out of core: model ``i``'s statistic in the anchor's basis as a mapping ``name ->
        tensor`` (read when asked for), taken by the merge engine ``job``
        (:class:`~symgraph.merging.streaming.StreamingMerge`) within its budget; None when the
        method needs none. A method that needs data implements it with
        :func:`~symgraph.merging.statistics.input_grams` (sums over data at linear inputs),
        :func:`~symgraph.merging.backprop.squared_gradients` (squared gradients of a loss, the
        graph differentiated segment by segment) or
        :func:`~symgraph.merging.statistics.whole_model` (one model loaded at a time); without
        it the merge loads the models, saying so."""
        if not self.needs_data:
            return None
        if getattr(job.ckpts[i], "module", None) is None:
            raise NotImplementedError(f"merge method {self.name!r} takes its statistics of loaded models only")
        return whole_model(job, i, self, f"{self.name}/{i}/")  # models in memory: measured as they are

    def sliceable(self, name: str, dim: int, report) -> bool:
        """Whether tensor ``name`` may be merged in slices along ``dim`` (the engine slices
        large tensors along an axis no map acts on; each slice's statistics are the same slice
        of the whole tensor's)."""
        return True

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
    unknown = sorted(set(kw) - set(_METHODS[method].parameters()))
    if unknown:
        raise InputError(f"merge method {method!r} has no parameter {unknown[0]!r}; expected "
                         f"{_METHODS[method].parameters() or 'no parameters'}")
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
