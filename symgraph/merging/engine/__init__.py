"""The merge engine as a plan and an executor, and what they read.

- ``plan``        :class:`~.plan.Plan` of :class:`~.plan.GroupTask` s: what each output tensor
  reads and how a large one is sliced, built once the alignment is known
- ``slicing``     a large group computed in slices along an axis no map acts on, and the
  smallest budget a plan fits in, checked before any alignment
- ``executor``    :class:`~.executor.Executor`: runs a plan's tasks in order on the device
  within the budget (read, carry into the anchor's basis, combine by the method, cast, correct,
  write), counting every byte it holds
- ``views``       lazy tensors the steps read (folded, aligned, both sides), their caches and
  the :class:`~.views.Ledger` of bytes held
- ``sinks``       where merged tensors go besides the output shards (a model in memory), and the
  output's config
- ``statistics``  the statistics a method may declare (:class:`~.statistics.InputGrams`,
  :class:`~.statistics.SquaredGradients`), the :class:`~.statistics.StatisticsContext` the
  engine builds, and :func:`~.statistics.take` / :func:`~.statistics.floor` per kind
- ``sums``        sums over data taken out of core (RegMean's input Grams by the op-by-op
  runner) and the store they spill to
- ``gradients``   squared gradients of a loss, the graph differentiated segment by segment
- ``measuring``   the merge as the executor computes it, corrected as a step measures it, and
  the :class:`~.measuring.RepairContext` the engine builds for REPAIR
- ``segments``    the traced graph cut into segments of at most the budget's weights
"""
from __future__ import annotations

from .executor import Executor
from .plan import GroupTask, Plan, build_plan

__all__ = ["Executor", "GroupTask", "Plan", "build_plan"]
