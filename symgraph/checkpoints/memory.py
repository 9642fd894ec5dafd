"""A model in memory read through the interface of :class:`~symgraph.checkpoints.sharded.Checkpoint`,
so that the merge engine (:class:`~symgraph.merging.streaming.StreamingMerge`) runs
:func:`symgraph.merge` over models already loaded exactly as it runs a merge of checkpoints
on disk: the same carry, combine, statistics and REPAIR, one tensor group at a time."""
from __future__ import annotations

import copy

import torch

from ..core.finite import check_read, require_module
from ..errors import InputError
from ..core.ties import parameter_names

__all__ = ["ModelCheckpoint"]


class ModelCheckpoint:
    """``module`` (a loaded ``torch.nn.Module``) as a checkpoint named ``label`` (what error
    messages call it). Its keys are the module's state-dict names with tied parameters once
    (under their first name, as ``save_pretrained`` stores them); :meth:`read` returns a copy
    (the engine never holds the caller's tensors), :meth:`fetch` the module's own tensor
    (parameters, persistent and computed buffers: a graph run reads them, never writes).
    ``model`` is the module itself (the analysis traces it as it is). The module is never
    modified."""

    def __init__(self, module: torch.nn.Module, label: str):
        require_module(module, label)
        self.model = self.module = module  # model: what the analysis traces (retyped: on meta)
        self.path = label
        self.config = getattr(module, "config", None)
        self.cls = type(module)
        self.source = None  # as stored: this is the model itself
        self.files: dict = {}
        self.params = parameter_names(module)
        alias = {a for names in self.params.values() for a in names[1:]}
        state = module.state_dict(keep_vars=True)
        self._tensors = {k: v for k, v in state.items() if k not in alias}  # tied names once
        self.keys = list(self._tensors)
        self.shapes = {k: tuple(v.shape) for k, v in self._tensors.items()}
        self.dtypes = {k: v.dtype for k, v in self._tensors.items()}
        floats = [d for d in self.dtypes.values() if d.is_floating_point]
        self.dtype = max(set(floats), key=floats.count) if floats else torch.float32
        self.key_of = {n: names[0] for n, names in self.params.items()}
        self.param_of = {a: n for n, names in self.params.items() for a in names}
        self._all = {**dict(module.named_buffers(remove_duplicate=False)),
                     **dict(module.named_parameters(remove_duplicate=False))}
        self._finite: set = set()

    def retyped(self, dtype) -> torch.nn.Module:
        """The module's architecture in ``dtype`` on the ``meta`` device (graphs of checkpoints
        stored in different dtypes run in one), leaving the module itself as it is."""
        meta = copy.deepcopy(self.module).to("meta")
        return meta.to(dtype)

    def read(self, key: str, check: bool = True, part=None) -> torch.Tensor:
        """A copy of tensor ``key`` (``part=(dim, start, stop)``: that slice), checked finite
        unless ``check=False``."""
        if key not in self._tensors:
            raise InputError(f"{self.path} has no tensor {key!r}; expected one of its state-dict names")
        t = self._tensors[key].detach()
        if part is not None:
            d, start, stop = part
            t = t.narrow(d, start, stop - start)
        if check:
            check_read(t, key, self._finite, part is None, self.path)
        return t.clone()

    def fetch(self, name: str) -> torch.Tensor:
        """The module's own parameter or buffer ``name`` (any of its names), for a graph run."""
        if name not in self._all:
            raise InputError(f"{self.path} has no tensor {name!r}; expected a parameter or buffer of the model")
        return self._all[name].detach()

    def key(self, name: str) -> str:
        """The key of parameter ``name`` (any of its tied names) or of buffer ``name``."""
        return self.key_of.get(self.param_of.get(name, name), name)

    def get(self, name: str, check: bool = True, part=None) -> torch.Tensor:
        """Parameter ``name`` (any of its tied names) or buffer ``name``; ``part`` as :meth:`read`."""
        return self.read(self.key(name), check, part)
