"""The safetensors dtype names symgraph reads and writes, and their torch dtypes (one table
for checkpoints, output shards and alignment files); a float64 model run in float64 throughout
(:func:`wide_floats`: certificates, and the trace and trial runs of a float64 model)."""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["SAFETENSORS_DTYPES", "SAFETENSORS_NAMES", "float64_throughout", "wide_floats"]

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


def float64_throughout(model):
    """:func:`wide_floats` where every floating parameter of ``model`` is float64, else nothing:
    a float64 model traced, and tried on example inputs, as its float32 twin is. Its own casts
    to float32 (XLNet's relative positions, ``arange(...).float()``) otherwise meet float64
    weights in one op, which refuses them (XLNet's query stream: "expected scalar type Double
    but found Float"), and the report of a float64 model would claim less than the float32
    one's."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return wide_floats() if dtypes == {torch.float64} else contextlib.nullcontext()
