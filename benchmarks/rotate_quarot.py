"""QuaRot's own released rotation code (spcl/QuaRot, ``fake_quant/``) run on the benchmark's
LLaMA model, beside ``symgraph rotate``, for :mod:`benchmarks.bench_rotate`.

QuaRot's code does not run on a CPU-only machine as released: it imports
``fast_hadamard_transform`` (a CUDA extension) and ``accelerate`` (for multi-GPU dispatch
only), and ``apply_exact_had_to_linear`` moves every weight to the GPU. It runs here unchanged
with three shims in this process only: ``fast_hadamard_transform`` as the same Walsh–Hadamard
transform in PyTorch (Sylvester's order, the CUDA kernel's), ``.cuda()`` as the identity while
QuaRot's functions run, and an empty ``accelerate``. Then it does what QuaRot's ``main.py`` does
for LLaMA with ``--rotate``: ``fuse_layer_norms``, ``rotate_model`` (``--rotate_mode
hadamard``), ``add_actquant`` and the online Hadamard transforms of ``down_proj``'s input (full)
and ``o_proj``'s (across heads). The quantizer is :mod:`symgraph.testing.quantize`'s (QuaRot's
own activation quantizers stay at 16 bits, i.e. off).
"""
from __future__ import annotations

import contextlib
import copy
import subprocess
import sys
import types
from pathlib import Path

import torch


def _fht(x, scale=1.0):
    """``fast_hadamard_transform.hadamard_transform``: the last dim (a power of two) multiplied
    by Sylvester's Hadamard matrix, times ``scale``."""
    n, shape = x.shape[-1], x.shape
    y, h = x.reshape(-1, n), 1
    while h < n:
        y = y.reshape(-1, n // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    return (y.reshape(shape) * scale).to(x.dtype)


@contextlib.contextmanager
def _on_cpu():
    """``Tensor.cuda`` as the identity (QuaRot moves weights to the GPU unconditionally)."""
    old = torch.Tensor.cuda
    torch.Tensor.cuda = lambda self, *a, **k: self
    try:
        yield
    finally:
        torch.Tensor.cuda = old


def _import(quarot: Path):
    """QuaRot's ``hadamard_utils``, ``quant_utils`` and ``rotation_utils``, with the shims."""
    fht = types.ModuleType("fast_hadamard_transform")
    fht.hadamard_transform = _fht
    acc, acc_utils = types.ModuleType("accelerate"), types.ModuleType("accelerate.utils")
    acc.dispatch_model = acc.infer_auto_device_map = acc_utils.get_balanced_memory = None
    acc.utils = acc_utils
    for name, mod in {"fast_hadamard_transform": fht, "accelerate": acc, "accelerate.utils": acc_utils}.items():
        sys.modules.setdefault(name, mod)
    path = str(Path(quarot) / "fake_quant")
    if path not in sys.path:
        sys.path.insert(0, path)
    import hadamard_utils  # noqa: E402 - QuaRot's modules, from its checkout
    import quant_utils
    import rotation_utils
    return hadamard_utils, quant_utils, rotation_utils


def quarot_rotated(model, quarot: Path):
    """A copy of the LLaMA ``model`` rotated by QuaRot's code, with the online Hadamard transforms
    its ``main.py`` adds; evaluated like any model."""
    hadamard_utils, quant_utils, rotation_utils = _import(quarot)
    m = copy.deepcopy(model).float().eval()
    with _on_cpu(), torch.no_grad():
        rotation_utils.fuse_layer_norms(m)
        rotation_utils.rotate_model(m, types.SimpleNamespace(rotate_mode="hadamard"))
        quant_utils.add_actquant(m)
        cfg = m.config
        for name, layer in quant_utils.find_qlayers(m).items():  # as QuaRot's main.py, for LLaMA
            if "down_proj" in name:
                layer.had_K, layer.K = hadamard_utils.get_hadK(cfg.intermediate_size)
                layer.online_full_had = True
            if "o_proj" in name:
                layer.had_K, layer.K = hadamard_utils.get_hadK(cfg.num_attention_heads)
                layer.online_partial_had = True
                layer.had_dim = cfg.hidden_size // cfg.num_attention_heads
    for p in m.parameters():  # rotate_model runs in inference mode: ordinary tensors again
        p.data = p.data.clone()
    return m


def quarot_commit(quarot: Path) -> str | None:
    """The commit of the QuaRot checkout (None where it is not a git checkout)."""
    r = subprocess.run(["git", "-C", str(quarot), "rev-parse", "HEAD"], capture_output=True, text=True)
    return r.stdout.strip() if r.returncode == 0 else None
