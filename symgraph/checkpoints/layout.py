"""Where each tensor of a checkpoint lives (:class:`Layout`), from the file headers alone:
what :func:`~.loading.read_layout` reads and :mod:`.converted` renames."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = ["Layout"]


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a checkpoint lives, from the file headers alone: ``files`` (tensor
    -> real shard path), ``shapes``, ``dtypes`` (torch dtypes), ``keys`` in index (or file)
    order. The one reading of a checkpoint every path shares (:func:`read_layout`). ``pins``:
    shard path -> its :class:`~symgraph.core.files.PinnedFile`, opened when the headers were
    read: every later read of the run goes through it and is checked against it."""
    files: dict
    shapes: dict
    dtypes: dict
    keys: list
    pins: dict = field(default_factory=dict, compare=False, repr=False)

    def check_unchanged(self) -> None:
        """Refuse (one line, naming the file) a shard replaced or rewritten since it was pinned."""
        for pin in self.pins.values():
            pin.check()

    @property
    def nbytes(self) -> int:
        """The bytes of the tensors' values (what a model of these tensors takes on disk)."""
        return sum(math.prod(self.shapes[k]) * torch.empty((), dtype=self.dtypes[k]).element_size()
                   for k in self.keys)

    @property
    def dtype(self):
        """The checkpoint's dtype: its most common floating-point tensor dtype (float32 without one)."""
        floats = [d for d in self.dtypes.values() if d.is_floating_point]
        return max(set(floats), key=floats.count) if floats else torch.float32
