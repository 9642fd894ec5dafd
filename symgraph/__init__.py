"""symgraph: a graph-based symmetry compiler for neural networks.

``analyze(model)`` traces a model and reports every weight-space symmetry its graph admits;
``transform`` applies a group element; ``report.certify`` checks a claim numerically.
"""
from __future__ import annotations

from .errors import (CertificationError, InputError, StructureMismatchError, SymgraphError,  # noqa: F401
                     TraceError, UnsupportedOpError)
from .passes import analyze_graph
from .report import Group, SymmetryReport, Transform  # noqa: F401
from .trace import trace
from .transform import transform  # noqa: F401
from .align import Alignment, align  # noqa: F401,E402
from .merge import interpolate, loss_barrier, merge  # noqa: F401,E402



def tied_parameters(model) -> list:
    """Groups of parameter names that share one tensor (tied embeddings, shared layers)."""
    by_id: dict = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


__version__ = "0.1.0"


def analyze(model, inputs=None, *, strict: bool = False) -> SymmetryReport:
    """Trace ``model`` and infer its symmetry groups.

    Parameters
    ----------
    model : torch.nn.Module
        Left untouched. Hugging Face models need no ``inputs`` (built from the config); a model
        on the ``meta`` device is analysed without weights.
    inputs : tuple | dict | None
        Positional example inputs, or keyword inputs.
    strict : bool
        Raise :class:`UnsupportedOpError` on an op without a rule instead of freezing its axes.
    """
    ep, args, kwargs = trace(model, inputs)
    an = analyze_graph(ep, strict=strict, tied=tied_parameters(model))
    return SymmetryReport(an, type(model).__name__, (args, kwargs))
