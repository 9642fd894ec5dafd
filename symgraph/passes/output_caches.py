"""Caches in a model's output: a transformers ``Cache`` is state for the next call of
``generate``, not an output a user of the model reads, and no exported program can hold one
(PI0.5 prefills its prefix with ``use_cache=True`` hard-coded and returns that cache, whatever
the config says). While tracing, such a model's output is taken without its caches."""
from __future__ import annotations

import contextlib
import functools

__all__ = ["caches_dropped"]


@contextlib.contextmanager
def caches_dropped(model):
    """While inside, ``model``'s forward returns its output without the transformers ``Cache``
    objects it holds (a model output rebuilt without those fields; ``None`` in their place in
    a tuple)."""
    from transformers.cache_utils import Cache
    forward = model.forward

    def drop(out):
        if isinstance(out, Cache):
            return None
        if type(out) in (tuple, list):
            return type(out)(drop(v) for v in out)
        if hasattr(out, "items") and any(isinstance(v, Cache) for v in out.values()):
            return type(out)(**{k: v for k, v in out.items() if not isinstance(v, Cache)})
        return out

    @functools.wraps(forward)
    def without_caches(*args, **kwargs):
        return drop(forward(*args, **kwargs))
    own = vars(model).get("forward")  # an instance's own forward (a hook's wrapper) is put back
    model.forward = without_caches
    try:
        yield model
    finally:
        if own is None:
            del model.forward
        else:
            model.forward = own
