"""A small simulated quantizer for tests and benchmarks of rotations (issue 64): what QuaRot
and SpinQuant measure, in fake quantization (values rounded, kept in floating point).

* :func:`rtn` rounds a weight to nearest, symmetric, per output row in groups of ``group``
  consecutive inputs (RTN int4, group 128, is the usual baseline); ``ste=True`` keeps the
  gradient of the unrounded value (a straight-through estimator, for learned rotations).
* :func:`quantize_weights` returns a copy of a model with every linear layer's weight so
  rounded (the output head kept, as QuaRot keeps it).
* :func:`activations` is a context manager quantizing every linear layer's input per token
  (symmetric, the largest magnitude of each token's vector sets its scale), through forward
  pre-hooks.

Linear layers are ``torch.nn.Linear`` and GPT-2's ``Conv1D`` (weight stored ``[in, out]``).
Stacked experts (a module whose own parameters are all 3-d, ``[experts, out, in]`` as
Hugging Face's Mixtral, Qwen3-MoE and OLMoE store them) have their weights rounded along the last
dim and their module input rounded per token; what they compute between two of their
weights (the gated hidden units, the down projection's input) is not reachable by a hook and
stays in floating point.
"""
from __future__ import annotations

import contextlib
import copy

import torch

__all__ = ["rtn", "per_token", "linear_layers", "stacked_experts", "quantize_weights", "activations",
           "weight_values"]


def rtn(w: torch.Tensor, bits: int = 4, group: int = 128, dim: int = -1, ste: bool = False) -> torch.Tensor:
    """``w`` rounded to ``bits``-bit symmetric integers along ``dim`` in groups of ``group``
    (a dim not divisible by ``group`` is one group per row), scale ``max|w| / (2^(bits-1) - 1)``
    per group."""
    x = w.movedim(dim, -1)
    n = x.shape[-1]
    g = group if group and n % group == 0 else n
    v = x.reshape(*x.shape[:-1], n // g, g)
    top = 2 ** (bits - 1) - 1
    scale = v.detach().abs().amax(-1, keepdim=True).clamp(min=1e-12) / top
    q = (torch.clamp(torch.round(v / scale), -top - 1, top) * scale).reshape(x.shape).movedim(-1, dim)
    return w + (q - w).detach() if ste else q


def per_token(x: torch.Tensor, bits: int = 8, ste: bool = False) -> torch.Tensor:
    """``x`` rounded per token (its last dim one vector, one scale) to ``bits``-bit symmetric integers."""
    return rtn(x, bits=bits, group=0, dim=-1, ste=ste)


def linear_layers(model) -> dict:
    """``{module name: (module, input dim of its weight)}`` of every linear layer but the
    output head (``get_output_embeddings``)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    kept = {id(m) for m in head.modules()} if isinstance(head, torch.nn.Module) else set()
    out = {}
    for name, mod in model.named_modules():
        if id(mod) in kept:  # the head, and a layer it wraps
            continue
        if isinstance(mod, torch.nn.Linear):
            out[name] = (mod, 1)
        elif type(mod).__name__ == "Conv1D" and getattr(mod, "weight", None) is not None and mod.weight.dim() == 2:
            out[name] = (mod, 0)
    return out


def stacked_experts(model) -> dict:
    """``{module name: module}`` of the modules whose own parameters are all 3-d (stacked
    experts, ``[experts, out, in]``)."""
    out = {}
    for name, mod in model.named_modules():
        own = list(mod.parameters(recurse=False))
        if own and all(p.dim() == 3 for p in own):
            out[name] = mod
    return out


def quantize_weights(model, bits: int = 4, group: int = 128):
    """A copy of ``model`` with every linear layer's weight (and every stacked expert weight)
    rounded by :func:`rtn` (the head kept)."""
    new = copy.deepcopy(model)
    with torch.no_grad():
        for mod, dim in linear_layers(new).values():
            mod.weight.copy_(rtn(mod.weight, bits, group, dim))
        for mod in stacked_experts(new).values():
            for p in mod.parameters(recurse=False):
                p.copy_(rtn(p, bits, group, -1))
    return new


def weight_values(model, values: dict, bits: int = 4, group: int = 128, ste: bool = True) -> dict:
    """``values`` (``{parameter name: tensor}``, as ``torch.func.functional_call`` takes) with
    the linear layers' weights rounded by :func:`rtn` (straight-through by default)."""
    out = dict(values)
    for name, (_, dim) in linear_layers(model).items():
        key = f"{name}.weight" if name else "weight"
        if key in out:
            out[key] = rtn(out[key], bits, group, dim, ste=ste)
    for name, mod in stacked_experts(model).items():
        for pname, _ in mod.named_parameters(recurse=False):
            key = f"{name}.{pname}" if name else pname
            if key in out:
                out[key] = rtn(out[key], bits, group, -1, ste=ste)
    return out


@contextlib.contextmanager
def activations(model, bits: int = 8, ste: bool = False, modules=None):
    """Within the block, every linear layer of ``model`` and every stacked experts module (the
    head kept; only those named in ``modules`` where given) sees its input rounded per token to
    ``bits`` bits (:func:`per_token`)."""
    def hook(_mod, args):
        return (per_token(args[0], bits, ste),) + tuple(args[1:])
    mods = {name: mod for name, (mod, _) in linear_layers(model).items()} | stacked_experts(model)
    handles = [mod.register_forward_pre_hook(hook) for name, mod in mods.items()
               if modules is None or name in modules]
    try:
        yield model
    finally:
        for h in handles:
            h.remove()
