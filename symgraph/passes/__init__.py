"""Analysis passes. Importing the rule files registers their rules (one file per op family)."""
from .rules import attention, matrix, pointwise, pooling, reductions, segments, views  # noqa: F401
from . import labels  # noqa: F401
from .driver import AxisAnalysis, analyze_graph  # noqa: F401
from .registry import has_rule, lookup, observed, register  # noqa: F401

__all__ = ['AxisAnalysis', 'analyze_graph', 'has_rule', 'lookup', 'register', 'observed']
