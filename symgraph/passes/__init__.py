"""Analysis passes. Importing the rule files registers their rules (one file per op family)."""
from . import attention, labels, matrix, pointwise, pooling, reductions, segments, views  # noqa: F401
from .analysis import AxisAnalysis, analyze_graph  # noqa: F401
from .registry import has_rule, lookup, observed, register  # noqa: F401

__all__ = ['AxisAnalysis', 'analyze_graph', 'has_rule', 'lookup', 'register', 'observed']
