"""``x @ wᵀ`` for the large float32 products of alignment and merging.

PyTorch multiplies float32 matrices on the CPU with MKL; on this project's reference machine (an
AMD EPYC with AVX-512) oneDNN's float32 kernel, which PyTorch ships for its own linear layers,
runs 15–40% faster on the products whose operands are row-major (a residual stream's rotation
of a weight, the similarity of a weight read along its rows), and as fast where one is a
transposed view, which MKL reads without a copy. Both compute in float32 with float32
accumulation; the results differ by the order of the sums (about 1e-6 relative)."""
from __future__ import annotations

import torch

__all__ = ["linear"]

_OP = (getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
       if torch.backends.mkldnn.is_available() else None)


def _rows(t: torch.Tensor) -> bool:
    return t.dim() == 2 and t.stride(-1) == 1 and t.stride(0) >= t.shape[1]


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.mT`` (``x [..., k]``, ``w [n, k]``): through oneDNN for float32 CPU matrices
    stored by rows with nothing to differentiate, else PyTorch's matmul."""
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
