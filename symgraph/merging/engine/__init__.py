"""The merge engine as a plan and an executor.

- ``plan``      :class:`~.plan.Plan` of :class:`~.plan.GroupTask` s: what each output tensor
  reads and how a large one is sliced, built once the alignment is known
- ``executor``  :class:`~.executor.Executor`: runs a plan's tasks in order on the device
  within the budget (read, carry into the anchor's basis, combine by the method, cast, correct,
  write), counting every byte it holds
- ``statistics``  the statistics a method may declare (:class:`~.statistics.InputGrams`,
  :class:`~.statistics.SquaredGradients`), the :class:`~.statistics.StatisticsContext` the
  engine builds, and :func:`~.statistics.take` / :func:`~.statistics.floor` per kind
"""
from __future__ import annotations

from .executor import Executor
from .plan import GroupTask, Plan, build_plan

__all__ = ["Executor", "GroupTask", "Plan", "build_plan"]
