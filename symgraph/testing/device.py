"""A test device that is not the CPU: ``fakegpu``, PyTorch's PrivateUse1 key registered from
Python (``torch.utils.backend_registration._setup_privateuseone_for_python_backend``, as
PyTorch's own ``test/test_privateuseone_python_backend.py`` does), its tensors wrapper
subclasses (``_make_wrapper_subclass``) reporting ``device='fakegpu:0'`` and computing on a CPU
tensor inside. Every op that mixes a ``fakegpu`` tensor with a CPU tensor of one or more
dimensions raises :class:`MixedDevices` (a CUDA device refuses the same; 0-dim CPU scalars
are allowed, as CUDA allows them): a tensor the library creates on the default device while
the model lives elsewhere fails a test here, on a machine without a GPU.

Autograd works (the backend has the device guard PyTorch's helper registers), so learned
matching runs too. Not a speed model: everything computes on the CPU.

:func:`install` registers it (once per process; PrivateUse1 can be named only once).
"""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["install", "DeviceTensor", "MixedDevices", "NAME"]

NAME = "fakegpu"
_CROSS = {"aten::_to_copy", "aten::copy_", "aten::_copy_from", "aten::_copy_from_and_resize"}
_installed = False
_lib = None  # the torch.library registration, kept alive once installed
_aten = None  # the device's own kernels of aten factories (_SIZED_FACTORIES), kept alive too


class MixedDevices(RuntimeError):
    """An op got tensors of the test device and CPU tensors (not 0-dim scalars)."""


class DeviceTensor(torch.Tensor):
    """A tensor on the test device: metadata of its own, values in ``raw`` (a CPU tensor)."""
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]  # torch's stub types it as a method

    @staticmethod
    def __new__(cls, raw):
        return torch.Tensor._make_wrapper_subclass(cls, raw.size(), strides=raw.stride(),
                                                   storage_offset=raw.storage_offset(), dtype=raw.dtype,
                                                   device=torch.device(NAME, 0), layout=raw.layout)

    def __init__(self, raw):
        self.raw = raw

    def __repr__(self):
        return f"DeviceTensor({self.raw!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _run(func, args, kwargs or {})


def _run(func, args, kwargs):
    flat, _ = tree_flatten((args, kwargs))
    if func._schema.name not in _CROSS:
        cpu = [tuple(x.shape) for x in flat if isinstance(x, torch.Tensor) and x.device.type != NAME and x.dim() > 0]
        if cpu and any(isinstance(x, torch.Tensor) and x.device.type == NAME for x in flat):
            raise MixedDevices(f"{func}: CPU tensor(s) of shape {cpu} mixed with {NAME} tensors")

    def unwrap(x):
        if isinstance(x, DeviceTensor):
            return x.raw
        if isinstance(x, torch.device) and x.type == NAME:
            return torch.device("cpu")
        return x
    out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
    dev = kwargs.get("device")
    if dev is not None and torch.device(dev).type != NAME:
        return out  # a copy to another device
    if torch.Tag.inplace_view in func.tags and isinstance(args[0], DeviceTensor):
        _mutate_metadata(func, args, kwargs)
    inputs = {id(x.raw) if isinstance(x, DeviceTensor) else id(x): x for x in flat if isinstance(x, torch.Tensor)}

    def wrap(y):
        if isinstance(y, torch.Tensor):
            same = inputs.get(id(y))  # an in-place op returns its input
            return same if same is not None else DeviceTensor(y)
        return y
    return tree_map(wrap, out)


def _mutate_metadata(func, args, kwargs):
    """An in-place view op (``squeeze_``, ``t_``, ...: matmul of a vector ends in ``squeeze_``)
    changed the shape of the CPU tensor inside: the same change on the wrapper's own metadata,
    not dispatched (as ``torch.utils._python_dispatch.return_and_correct_aliasing`` does)."""
    with torch.utils._mode_utils.no_dispatch():
        meta = torch._C._meta_in_tls_dispatch_include()
        torch._C._set_meta_in_tls_dispatch_include(True)
        try:
            func(*args, **kwargs)
        finally:
            torch._C._set_meta_in_tls_dispatch_include(meta)


def _factory(op, *args, **kwargs):
    """The PrivateUse1 backend itself: reached by ops without a DeviceTensor argument (factories
    such as ``torch.empty(..., device='fakegpu')``)."""
    return _run(op, args, kwargs)


#: factories whose composite kernels fill an empty ``out=`` tensor they resize, which a wrapper
#: tensor's metadata does not follow (``torch.arange(32, device='fakegpu')`` had shape (0,)):
#: given kernels of their own on the device, computed on the CPU and wrapped
_SIZED_FACTORIES = ("arange", "arange.start", "arange.start_step", "eye", "eye.m")


def _sized_factory(op):
    def kernel(*args, **kwargs):
        return DeviceTensor(op(*args, **{**kwargs, "device": torch.device("cpu")}))
    return kernel


def install() -> str:
    """Register the ``fakegpu`` device (idempotent); returns its name."""
    global _installed, _lib, _aten
    if not _installed:
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend
        _setup_privateuseone_for_python_backend(NAME)
        _lib = torch.library.Library("_", "IMPL")
        _aten = torch.library.Library("aten", "IMPL")
        _lib.fallback(_factory, "PrivateUse1")
        for name in _SIZED_FACTORIES:
            packet, _, overload = name.partition(".")
            _aten.impl(name, _sized_factory(getattr(getattr(torch.ops.aten, packet), overload or "default")),
                       "PrivateUse1")
        _installed = True
    return NAME
