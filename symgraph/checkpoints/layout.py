"""Where each tensor of a checkpoint lives (:class:`Layout`), from the file headers alone:
what :func:`~.loading.read_layout` reads and :mod:`.converted` renames."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch

from ..core.schema import quoted
from ..errors import InputError

__all__ = ["Layout", "read_pinned"]


def read_pinned(pins: dict, file: str, key: str, part=None, where: str | None = None) -> torch.Tensor:
    """The tensor ``key`` of shard ``file`` (``part=(dim, start, stop)``: that slice only), read
    through the file's pin in ``pins`` (checked unchanged before and after: a file rewritten in
    place while it was read says so); a file safetensors cannot open is refused in one line
    naming ``where`` (default: its directory). The file is mapped only for the read."""
    from safetensors import safe_open
    pin = pins.get(file)
    if pin is not None:
        pin.check()
    try:
        handle = safe_open(pin.reader if pin is not None else file, framework="pt", device="cpu")
    except Exception as e:  # noqa: BLE001 - safetensors' own errors (truncated, corrupt header)
        if pin is not None:
            pin.check()  # a file that changed says so
        raise InputError(f"cannot read the weights of {where or os.path.dirname(file)!r} ({os.path.basename(file)}): "
                         f"{quoted(e)}; expected valid safetensors files written by save_pretrained") from None
    with handle as h:
        if part is None:
            t = h.get_tensor(key)
        else:
            d, start, stop = part
            t = h.get_slice(key)[(slice(None),) * d + (slice(start, stop),)]
    if pin is not None:
        pin.check()
    return t


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

    def read(self, key: str, where: str | None = None) -> torch.Tensor:
        """The stored tensor ``key``, read through its file's pin (:func:`read_pinned`)."""
        return read_pinned(self.pins, self.files[key], key, where=where)

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
