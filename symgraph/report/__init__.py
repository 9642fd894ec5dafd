"""The symmetry report: ``analyze`` (``api``) builds :class:`SymmetryReport` (``symmetry``:
groups, certificate, the documented view of the analysis); ``draw`` draws its class graph."""
from .api import analyze, tied_parameters  # noqa: F401
from .symmetry import Group, SymmetryReport, Transform  # noqa: F401
