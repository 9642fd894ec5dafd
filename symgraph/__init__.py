"""symgraph: a graph-based symmetry compiler for neural networks.

``analyze(model)`` traces a model and reports every weight-space symmetry its graph admits;
``transform`` applies a group element; ``align`` fills every class for two models; ``merge``
aligns and combines N models; ``resize`` widens or compresses classes;
``interpolate``/``loss_barrier`` evaluate the result.
This module only re-exports; see docs/architecture.md for where each piece lives.
"""
from __future__ import annotations

from .alignment import AlignOptions, Alignment, align, load_alignment
from .report.api import analyze, tied_parameters
from .transform.apply import transform
from .errors import CertificationError, InputError, StructureMismatchError, SymgraphError, TraceError, UnsupportedOpError
from .merging.barrier import interpolate, loss_barrier
from .merging import MergeResult, merge, merge_methods, register_merge
from .report.symmetry import Group, SymmetryReport, Transform
from .merging.resize import ResizeResult, resize
from .merging.run import merge_checkpoints

from ._version import __version__

__all__ = [
    "analyze", "tied_parameters", "SymmetryReport", "Group", "Transform", "transform",
    "align", "AlignOptions", "Alignment", "load_alignment", "merge", "MergeResult", "merge_methods", "merge_checkpoints",
    "register_merge", "resize", "ResizeResult", "interpolate", "loss_barrier", "SymgraphError",
    "InputError",
    "StructureMismatchError", "TraceError", "UnsupportedOpError", "CertificationError",
    "__version__",
]
