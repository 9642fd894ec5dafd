"""The merge engine as a plan and an executor, and what they read.

- ``steps``       the merge's steps in order (analyse, refuse, align, statistics, widen, REPAIR, write)
- ``plan``        :class:`~.plan.Plan` of :class:`~.plan.GroupTask` s: what each output tensor reads
- ``slicing``     a large group computed in slices, and the smallest budget a plan fits in
- ``executor``    :class:`~.executor.Executor`: runs a plan's tasks within the budget on the device
- ``views``       lazy tensors the steps read, their caches and the :class:`~.views.Ledger` of bytes
- ``sinks``       where merged tensors go besides a checkpoint directory
- ``statistics``  the statistics a method may declare and how the engine takes each kind
- ``sums``        sums over data taken out of core (RegMean's Grams) and the store they spill to
- ``gradients``   squared gradients of a loss, the graph differentiated segment by segment
- ``measuring``   the merge as the executor computes it, corrected as a step measures it (REPAIR)
- ``segments``    the traced graph run op by op, or in segments of at most the budget's weights
"""
from __future__ import annotations

from .executor import Executor
from .plan import GroupTask, Plan, build_plan

__all__ = ["Executor", "GroupTask", "Plan", "build_plan"]
