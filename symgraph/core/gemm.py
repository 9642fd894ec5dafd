"""``x @ wᵀ`` and the other matrix products of alignment and merging.

PyTorch multiplies float32 matrices on the CPU with MKL; on this project's reference machine (an
AMD EPYC with AVX-512) oneDNN's float32 kernel, which PyTorch ships for its own linear layers,
runs 15–40% faster on the products whose operands are row-major (a residual stream's rotation
of a weight, the similarity of a weight read along its rows), and as fast where one is a
transposed view, which MKL reads without a copy. Both compute in float32 with float32
accumulation; the results differ by the order of the sums (about 1e-6 relative).

bfloat16 and float16 products (weight matching's permutation classes run in the weights' own
dtype) have fast CPU kernels only where oneDNN has them (AVX-512 BF16, AVX512-FP16, AMX); on
other CPUs (AVX2, e.g. AMD EPYC before Zen 4) PyTorch's reference kernel runs about 1 GFLOP/s,
against 50-100 per core in float32. There they are computed in float32 and rounded once to the
inputs' dtype, what the fast kernels do too (float32 accumulation, one rounding)."""
from __future__ import annotations

import functools

import torch

__all__ = ["linear", "matmul", "einsum", "graph_op", "slow_on_cpu"]

#: oneDNN's probe of its kernels for each half dtype (what PyTorch dispatches CPU products to)
_PROBES = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}

_OP = (getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
       if torch.backends.mkldnn.is_available() else None)


def _rows(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(-1) == 1 and t.stride(0) >= t.shape[1]


@functools.lru_cache(maxsize=None)
def slow_on_cpu(dtype: torch.dtype) -> bool:
    """Whether CPU matrix products in ``dtype`` lack a fast kernel on this machine: a half dtype
    oneDNN has no kernel for here (or whose probe this PyTorch lacks)."""
    name = _PROBES.get(dtype)
    if name is None:
        return False
    probe = getattr(getattr(torch.ops, "mkldnn", None), name, None)
    try:
        return not (torch.backends.mkldnn.is_available() and probe is not None and bool(probe()))
    except RuntimeError:
        return True


def _slow(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and slow_on_cpu(t.dtype) and not (torch.is_grad_enabled() and t.requires_grad)


def _exact(f, args):
    """``f``, or where ``args``' tensors share a half dtype whose CPU products are slow (the
    first tensor decides), ``f`` on their float32 copies with its result rounded once to it."""
    ts = [a for a in args if isinstance(a, torch.Tensor)]
    if not ts or not _slow(ts[0]) or any(t.dtype != ts[0].dtype for t in ts):
        return f
    dtype = ts[0].dtype

    def in_float32(*a, **k):
        return f(*(x.float() if isinstance(x, torch.Tensor) else x for x in a), **k).to(dtype)
    return in_float32


def matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b``; half-precision CPU operands without a fast kernel are multiplied in float32
    and the result rounded to their dtype."""
    return _exact(torch.matmul, (a, b))(a, b)


def einsum(equation: str, *operands: torch.Tensor) -> torch.Tensor:
    """``torch.einsum``, half-precision CPU operands as :func:`matmul` takes them."""
    return _exact(torch.einsum, operands)(equation, *operands)


#: The products of a traced graph (ATen) that :func:`graph_op` computes in float32
_GRAPH_PRODUCTS = frozenset(getattr(torch.ops.aten, op).default for op in (
    "mm", "addmm", "bmm", "baddbmm", "linear", "matmul", "convolution"))


def graph_op(target, args):
    """What a graph run calls for its op ``target`` on ``args``: the op itself, or for a product
    of CPU half-precision tensors without a fast kernel, the op in float32 rounded once to
    their dtype (the model's own function, as the fast kernels compute it)."""
    return _exact(target, args) if target in _GRAPH_PRODUCTS else target


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.mT`` (``x [..., k]``, ``w [n, k]``): through oneDNN for float32 CPU matrices
    stored by rows with nothing to differentiate, half-precision ones as :func:`matmul` takes
    them, else PyTorch's matmul."""
    f = _exact(linear, (x, w))
    if f is not linear:
        return f(x, w)
    if (_OP is not None and x.dtype == torch.float32 and w.dtype == torch.float32
            and x.device.type == "cpu" and w.device.type == "cpu" and _rows(x) and _rows(w)
            and x.shape[0] and w.shape[0] and x.shape[1]
            and not (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
        try:
            return _OP(x, w, None, "none", [], "")
        except RuntimeError:  # a build whose oneDNN refuses it: PyTorch's matmul from now on
            _disable()
    return x @ w.mT


def _disable() -> None:
    global _OP
    _OP = None
