"""Exceptions raised by symgraph. Every message names what was wrong and what was expected."""

__all__ = ['SymgraphError', 'TraceError', 'UnsupportedOpError', 'CertificationError', 'InputError', 'StructureMismatchError', 'NeedsMemory',
           'UnsizedOnMeta']


class SymgraphError(Exception):
    """Base class of all symgraph errors."""


class TraceError(SymgraphError):
    """The model could not be traced with ``torch.export``."""


class UnsupportedOpError(SymgraphError):
    """``strict=True`` analysis met an op that has no symmetry rule."""


class CertificationError(SymgraphError):
    """A claimed symmetry changed the model's outputs beyond tolerance."""


class InputError(SymgraphError, ValueError):
    """Bad user input: wrong types, shapes, NaN weights, missing data."""


class StructureMismatchError(SymgraphError, ValueError):
    """Two models' graphs differ in structure and cannot be aligned."""


class NeedsMemory(InputError):
    """An out-of-core job met something only loaded models can run (the in-memory path can)."""


class UnsizedOnMeta(TraceError, NeedsMemory):
    """A model on ``meta`` (a checkpoint read by its headers) whose traced program has a size
    or a branch only its data decide (``nonzero``, ``unique_consecutive`` of a token mask, a
    router's ``if expert_mask.any()``): no value is at hand to take it from, and the model
    loaded with its weights can be traced."""
