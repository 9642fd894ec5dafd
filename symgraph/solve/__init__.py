"""Solvers: one entry point per problem, results as :class:`SolveResult`.

Every solver maximises ``<X, S>`` (the Frobenius inner product) for a similarity ``S`` of shape
``[n_A, n_B]`` over its feasible set; ``X`` maps B's coordinates into A's (``x_A ≈ X x_B``).

- ``turns``  host assignment solves of independent units at once, the rest one at a time
"""
from ._nested import nested_tree
from ._solvers import SolveResult, hungarian, signed_hungarian, inner_blocks, nested_heads, procrustes_mean, optimal_transport, procrustes, rope_procrustes, solve

__all__ = ['SolveResult', 'hungarian', 'signed_hungarian', 'inner_blocks', 'nested_heads', 'nested_tree', 'optimal_transport', 'procrustes', 'procrustes_mean', 'rope_procrustes', 'solve']
