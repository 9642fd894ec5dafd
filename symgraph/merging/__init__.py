"""Merging: align N models to an anchor (or into a shared universe), then combine with a
registered method, in memory or out of core, on one engine.

- ``config``, ``rules``, ``options``  the one frozen :class:`~.config.MergeConfig` every entry
  takes (command line, YAML, :func:`merge`, :func:`~.run.merge_checkpoints`), its rules between
  options (its validator) and the flags derived from it
- ``run``       :func:`~.run.run_merge`, the one merge entry of a config
- ``registry``  :class:`MergeMethod` (its typed ``Parameters``) and ``@register(name)``; every
  file in ``methods/`` is discovered
- ``engine.statistics``  the statistics a method may declare (:class:`InputGrams`,
  :class:`SquaredGradients`), which the engine takes out of core
- ``average``, ``fisher``, ``regmean``  one method each
- ``driver``    :func:`merge` and :class:`MergeResult`
- ``streaming`` the merge engine; ``universe`` / ``universe_stream``: the shared universe in
  memory / as rounds of engine plans out of core
"""
from __future__ import annotations

from .driver import MergeResult, merge
from .methods.registry import MergeMethod, MethodParameters, get, names, register
from .engine.statistics import InputGrams, SquaredGradients

merge_methods = names
register_merge = register

__all__ = ["merge", "MergeResult", "MergeMethod", "MethodParameters", "register", "register_merge", "merge_methods",
           "get", "names", "InputGrams", "SquaredGradients"]
