"""The symmetry report.

- ``api``       :func:`~.api.analyze`: trace a model and report its symmetry groups
- ``symmetry``  :class:`~.symmetry.SymmetryReport` (groups, frozen ops, elements) and its base
  :class:`~.symmetry.AxisQueries`, the one documented view of the analysis
- ``group``     one group of a report and one element per group
- ``certify``   the certificate: random elements applied, outputs compared in float64
- ``draw``      the transport-map flow drawn (networkx, Graphviz, PNG/SVG)
"""
from .api import analyze, tied_parameters  # noqa: F401
from .symmetry import Group, SymmetryReport, Transform  # noqa: F401
