"""Indices given as a list of one-element tensors, stacked while tracing (see :mod:`.trace`).

A forward that indexes with a tuple whose entries are sequences of 0-dim tensors (UDOP's
``rows, cols = zip(*ind); patch_inds[rows, cols] = False``: iterating a tensor yields 0-dim
tensors) has torch build each sequence into an index tensor by reading every element's data
(``torch.tensor``); under ``torch.export`` those elements are fake tensors without data ("The
tensor has a non-zero number of elements, but its data is not allocated yet"). While tracing,
such a sequence is passed as ``torch.stack`` of its elements instead: the same index tensor
(same values and dtype), built by an op the trace records. Any other index is passed as given,
and a list at the top level (which torch reads as a tuple of indices) is never touched.
"""
from __future__ import annotations

import contextlib

import torch

__all__ = ["stacked_index", "stacked_index_lists"]


def _scalars(seq) -> bool:
    """Whether ``seq`` is a non-empty list or tuple of 0-dim integer or boolean tensors of one
    dtype (what ``torch.stack`` turns into the tensor torch itself would build from it)."""
    if not (isinstance(seq, (list, tuple)) and seq and all(isinstance(t, torch.Tensor) and t.dim() == 0 for t in seq)):
        return False
    dtypes = {t.dtype for t in seq}
    return len(dtypes) == 1 and not next(iter(dtypes)).is_floating_point and not next(iter(dtypes)).is_complex


def stacked_index(index):
    """``index`` with each entry of a tuple index that is a sequence of 0-dim integer or boolean
    tensors replaced by their ``torch.stack``; any other index unchanged."""
    if not isinstance(index, tuple) or not any(_scalars(i) for i in index):
        return index
    return tuple(torch.stack(list(i)) if _scalars(i) else i for i in index)


class _Stacked(torch.overrides.TorchFunctionMode):
    """``Tensor.__getitem__`` and ``__setitem__`` with their index through :func:`stacked_index`
    (a mode: torch hands it the index before it builds tensors from the index's sequences)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and len(args) >= 2:
            args = (args[0], stacked_index(args[1]), *args[2:])
        return func(*args, **kwargs)


@contextlib.contextmanager
def stacked_index_lists():
    """While inside, ``Tensor.__getitem__`` and ``__setitem__`` take their index through
    :func:`stacked_index`."""
    with _Stacked():
        yield
