"""Merging: align N models to an anchor (or into a shared universe), then combine with a
registered method, in memory or out of core, on one engine.

- ``config``         the one frozen :class:`~.config.MergeConfig` every entry takes, and its rules
- ``methods``        the methods (:class:`MergeMethod`, ``@register(name)``), one file per method
- ``engine``         the plan, its executor, the statistics' vocabulary, the budget's views and ledger
- ``streaming``      :class:`~.streaming.StreamingMerge`: a merge's steps (align, statistics,
  REPAIR, write) over checkpoints or models, from one config
- ``driver``         :func:`merge` and :class:`MergeResult`: the engine over models in memory
- ``learned``        learned matching out of core: the segmented graph as the loop's objective
- ``repair``         REPAIR's sites, moments and corrections, and its report
- ``repair_stream``  REPAIR as the engine's step, BatchNorm resets in the same pass
- ``universe``       the shared universe: rounds of engine plans, in memory and out of core
- ``circuits``       circuit-space heads: the parents' QK and OV forms, as the engine's combine
  (untying, for ``untie``: :func:`symgraph.core.ties.untie`, and the checkpoint's
  :meth:`~symgraph.checkpoints.sharded.Checkpoint.untied`)
"""
from __future__ import annotations

from .driver import MergeResult, merge
from .methods.registry import MergeMethod, MethodParameters, get, names, register
from .engine.statistics import InputGrams, SquaredGradients

merge_methods = names
register_merge = register

__all__ = ["merge", "MergeResult", "MergeMethod", "MethodParameters", "register", "register_merge", "merge_methods",
           "get", "names", "InputGrams", "SquaredGradients"]
