"""The safetensors dtype names symgraph reads and writes, and their torch dtypes (one table
for checkpoints, output shards and alignment files); a float64 model run in float64 throughout
(:func:`wide_floats`: certificates); a contraction of operands of two floating dtypes run in the
model's (:func:`parameters_dtype`)."""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

__all__ = ["SAFETENSORS_DTYPES", "SAFETENSORS_NAMES", "parameters_dtype", "wide_floats"]

SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}
SAFETENSORS_NAMES = {v: k for k, v in SAFETENSORS_DTYPES.items()}


_NARROW = {torch.float32: torch.float64, torch.float16: torch.float64, torch.bfloat16: torch.float64,
           torch.complex64: torch.complex128, torch.complex32: torch.complex128}
_TO_DOUBLE = {torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16}


def _widen(x):
    if isinstance(x, torch.dtype):
        return _NARROW.get(x, x)
    if type(x) in (list, tuple):
        return type(x)(_widen(v) for v in x)
    return x


class _WideFloats(TorchFunctionMode):
    """Every float dtype a torch call asks for (``.to(torch.float32)``, ``.float()``,
    ``softmax(dtype=...)``, ``arange(dtype=torch.float)``) read as float64 (complex as complex128);
    a reinterpreting ``view(dtype)`` is left alone."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _TO_DOUBLE and args and isinstance(args[0], torch.Tensor):
            return args[0].double()
        if func is torch.Tensor.view:
            return func(*args, **kwargs)
        return func(*_widen(tuple(args)), **{k: _widen(v) for k, v in kwargs.items()})


@contextlib.contextmanager
def wide_floats():
    """Run a float64 model in float64 throughout: its own casts to narrower float dtypes, and
    tensors made at the default dtype, stay float64 (see :func:`symgraph.report.certify.certify`)."""
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with _WideFloats():
            yield
    finally:
        torch.set_default_dtype(old)


class _OneDtype(TorchFunctionMode):
    """A contraction (:data:`_CONTRACTIONS`) whose floating operands differ in dtype, which torch
    refuses, run with them cast to ``dtype``; every other call as it is."""

    def __init__(self, dtype):
        super().__init__()
        self.dtype = dtype

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _CONTRACTIONS:
            floats = {a.dtype for a in tree_flatten((args, kwargs))[0]
                      if isinstance(a, torch.Tensor) and a.is_floating_point()}
            if len(floats) > 1 and self.dtype in floats:
                cast = lambda a: a.to(self.dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() else a  # noqa: E731
                args, kwargs = tree_map(cast, args), tree_map(cast, kwargs)
        return func(*args, **kwargs)


_CONTRACTIONS = {torch.einsum, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.mm,
                 torch.nn.functional.linear}


def parameters_dtype(model):
    """While inside, a contraction of tensors of different floating dtypes (``einsum``,
    ``matmul``, ``linear``: torch refuses them) runs in the dtype of ``model``'s floating
    parameters, where they have one, as a model's own cast would make it (XLNet's
    ``r.type(self.r.dtype)``); every call torch accepts runs as it is. XLNet's query stream
    (``target_mapping``) contracts relative positions it makes at float32
    (``arange(...).float()``) with the weights without that cast: in float64, bfloat16 or
    float16 its forward refused the query stream, left ``mask_emb`` unread and its report
    claimed nothing, where float32's claims every head's maps. The trace, the certificate
    and the trial runs that choose example inputs run under it, so the report does not depend
    on the model's dtype."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return _OneDtype(next(iter(dtypes))) if len(dtypes) == 1 else contextlib.nullcontext()
