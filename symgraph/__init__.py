"""symgraph: a graph-based symmetry compiler for neural networks.

``analyze(model)`` traces a model and reports every weight-space symmetry its graph admits;
``transform`` applies a group element; ``align`` fills every class for two models; ``merge``
aligns and combines N models; ``resize`` widens or compresses classes;
``interpolate``/``loss_barrier`` evaluate the result.
This module only re-exports; see docs/architecture.md for where each piece lives.

Importing it is cheap: each public name is imported from its module on first use (PEP 562's
module ``__getattr__``), so ``import symgraph`` and the ``symgraph`` command start without
loading torch. ``from symgraph import analyze`` and ``dir(symgraph)`` work as usual.
"""
from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import CertificationError, InputError, StructureMismatchError, SymgraphError, TraceError, UnsupportedOpError

if TYPE_CHECKING:  # what type checkers and readers see; at run time __getattr__ imports them
    from .alignment import AlignOptions, Alignment, align, load_alignment
    from .alignment.compare import compare
    from .core.groups import GroupKind
    from .merging import MergeResult, merge, merge_methods, register_merge
    from .evaluation.barrier import interpolate, loss_barrier
    from .width.resize import ResizeResult, resize
    from .rotation.rotate import RotateResult, rotate
    from .app.run import merge_checkpoints
    from .report.api import analyze, tied_parameters
    from .report.symmetry import Group, SymmetryReport, Transform
    from .transform.apply import transform

__all__ = [
    "analyze", "tied_parameters", "SymmetryReport", "Group", "GroupKind", "Transform", "transform",
    "align", "AlignOptions", "Alignment", "load_alignment", "merge", "MergeResult", "merge_methods", "merge_checkpoints",
    "register_merge", "resize", "ResizeResult", "rotate", "RotateResult", "interpolate", "loss_barrier", "compare", "SymgraphError",
    "InputError",
    "StructureMismatchError", "TraceError", "UnsupportedOpError", "CertificationError",
    "__version__",
]

#: Where each lazily imported public name lives.
_LAZY = {
    "analyze": ".report.api", "tied_parameters": ".report.api", "SymmetryReport": ".report.symmetry",
    "Group": ".report.symmetry", "GroupKind": ".core.groups", "Transform": ".report.symmetry", "transform": ".transform.apply",
    "align": ".alignment", "AlignOptions": ".alignment", "Alignment": ".alignment", "load_alignment": ".alignment",
    "merge": ".merging", "MergeResult": ".merging", "merge_methods": ".merging", "register_merge": ".merging",
    "merge_checkpoints": ".app.run", "resize": ".width.resize", "ResizeResult": ".width.resize",
    "rotate": ".rotation.rotate", "RotateResult": ".rotation.rotate",
    "interpolate": ".evaluation.barrier", "loss_barrier": ".evaluation.barrier",
    "compare": ".alignment.compare",
}


def __getattr__(name: str) -> Any:
    """Import a public name from its module on first use, and keep it here."""
    where = _LAZY.get(name)
    if where is None:
        raise AttributeError(f"module 'symgraph' has no attribute {name!r}")
    value = getattr(importlib.import_module(where, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list:
    return sorted(set(globals()) | set(__all__))


class _Root(types.ModuleType):
    """``symgraph.transform`` is the function, not the subpackage of the same name: importing
    ``symgraph.transform.apply`` must not bind the subpackage here (the import system sets a
    loaded subpackage as an attribute of its parent); it stays in ``sys.modules``."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _LAZY and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Root
