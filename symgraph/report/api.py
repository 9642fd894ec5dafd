"""The entry point of the analysis: trace a model and report its symmetry groups."""
from __future__ import annotations

from ..core.ties import tied_groups
from ..core.finite import require_bool, require_module
from ..passes import analyze_graph
from ..passes.nodes import UNSAVED, unsaved_values
from .symmetry import SymmetryReport
from ..passes.trace import head_outputs, output_positions, trace

__all__ = ["analyze", "tied_parameters"]


def tied_parameters(model) -> list:
    """Groups of parameter names that share one tensor (tied embeddings, shared layers)."""
    require_module(model, "model")
    return tied_groups(model)


def analyze(model, inputs=None, *, strict: bool = False, fold_norms: bool = True,
            outputs=None) -> SymmetryReport:
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
    fold_norms : bool
        Describe the model with foldable norm gains folded into the layers that read them
        (``report.folds``): residual streams then admit orthogonal maps, not only permutations.
    outputs : the outputs a symmetry must keep: keys of the model's output (``["logits"]``) or
        positions of a tuple output. Default: a head model's (one with a ``logits`` output) outputs
        other than hidden states (BART's ``encoder_last_hidden_state``, CLIP's
        ``text_model_output``: see :func:`symgraph.passes.trace.head_outputs`), every output of
        any other model. ``"all"``: every output; hidden states kept fix the streams they come
        from, since a symmetry would change them.
    """
    require_bool(strict, "strict")
    require_bool(fold_norms, "fold_norms")
    ep, args, kwargs = trace(model, inputs)
    ep.graph_module.meta[UNSAVED] = sorted(getattr(model, "_keys_to_ignore_on_save", None) or ())
    unsaved_values(ep, model)  # on meta: the values of what a checkpoint does not store
    outputs = None if outputs is None else tuple([outputs] if isinstance(outputs, str) else outputs)
    if outputs is None:
        outputs = head_outputs(ep)
    elif outputs == ("all",):
        outputs = None
    an = analyze_graph(ep, strict=strict, tied=tied_parameters(model), fold_norms=fold_norms,
                       keep=output_positions(ep, outputs))
    return SymmetryReport(an, type(model).__name__, (args, kwargs), outputs)
