"""Example inputs for a diffusers model, built from its config and its forward's signature (no
data), so ``symgraph.analyze(model)`` needs no ``inputs=`` for the UNet, the DiT, SD3's MMDiT,
Flux or the VAE:

- the noisy input: an image ``sample`` / ``hidden_states`` of the configured channels, at the
  configured sample size (at most 32), or, for a model that takes position ids
  (``img_ids``: Flux), a sequence of packed tokens with their ids (row and column on a grid);
- ``timestep`` (floats; fractions of one where the model scales them itself, as Flux does);
- ``encoder_hidden_states`` of the text width the config names (``encoder_hid_dim``,
  ``cross_attention_dim`` or ``joint_attention_dim``), with ``txt_ids`` beside them;
- ``pooled_projections``, ``class_labels`` (DiT's ``num_embeds_ada_norm``, a UNet's
  ``num_class_embeds``) and ``guidance`` where the config asks for them;
floating inputs in the model's dtype and on its device.
"""
from __future__ import annotations

import inspect
import sys

import torch

from ..errors import InputError

__all__ = ["diffusers_inputs", "is_diffusers"]

BATCH, TEXT, SIDE = 2, 5, 32


def is_diffusers(model) -> bool:
    """Whether ``model`` is a diffusers model (diffusers is imported wherever one exists)."""
    d = sys.modules.get("diffusers")
    return d is not None and isinstance(model, getattr(d, "ModelMixin", ()))


def _first(v):
    return v[0] if isinstance(v, (list, tuple)) else v


def _cfg(cfg, *names):
    for n in names:
        v = _first(cfg.get(n)) if hasattr(cfg, "get") else None
        if isinstance(v, int) and not isinstance(v, bool):
            return v
    return None


def _image(cfg, params, gen):
    name = "sample" if "sample" in params else "hidden_states"
    ch = _cfg(cfg, "in_channels")
    if ch is None or name not in params:
        raise InputError("cannot tell a diffusers model's main input (sample or hidden_states) and its "
                         "channels from its config; pass inputs=")
    if "img_ids" in params:  # packed tokens with their positions (Flux)
        n = 4
        grid = torch.stack(torch.meshgrid(torch.arange(2), torch.arange(2), indexing="ij"), -1).reshape(n, 2)
        axes = len(cfg.get("axes_dims_rope") or (0, 0, 0))
        ids = torch.cat([torch.zeros(n, max(0, axes - 2)), grid.float()], 1)[:, -axes:] if axes else grid.float()
        return {name: torch.randn(BATCH, n, ch, generator=gen), "img_ids": ids}
    side = min(_cfg(cfg, "sample_size") or SIDE, SIDE)
    limit = _cfg(cfg, "pos_embed_max_size")
    if limit:
        side = min(side, limit * (_cfg(cfg, "patch_size") or 1))
    return {name: torch.randn(BATCH, ch, side, side, generator=gen)}


def _conditions(cfg, params, kwargs, gen) -> None:
    if "timestep" in params:
        scaled = "img_ids" in params  # Flux multiplies its timesteps by 1000 itself
        kwargs["timestep"] = torch.tensor([0.3, 0.7] if scaled else [3.0, 7.0])
    text = _cfg(cfg, "encoder_hid_dim", "cross_attention_dim", "joint_attention_dim")
    if "encoder_hidden_states" in params and text:
        kwargs["encoder_hidden_states"] = torch.randn(BATCH, TEXT, text, generator=gen)
        if "txt_ids" in params:
            kwargs["txt_ids"] = torch.zeros(TEXT, kwargs["img_ids"].shape[1])
    pooled = _cfg(cfg, "pooled_projection_dim")
    if "pooled_projections" in params and pooled:
        kwargs["pooled_projections"] = torch.randn(BATCH, pooled, generator=gen)
    classes = _cfg(cfg, "num_embeds_ada_norm", "num_class_embeds")
    if "class_labels" in params and classes and cfg.get("class_embed_type") is None:
        kwargs["class_labels"] = torch.arange(BATCH) % classes
    if "guidance" in params and cfg.get("guidance_embeds"):
        kwargs["guidance"] = torch.full((BATCH,), 3.5)


def diffusers_inputs(model):
    """``((), kwargs)``: example inputs for the diffusers ``model`` (see the module's docstring)."""
    cfg = model.config
    params = inspect.signature(model.forward).parameters
    gen = torch.Generator().manual_seed(0)
    kwargs = _image(cfg, params, gen)
    _conditions(cfg, params, kwargs, gen)
    p = next(iter(model.parameters()), None)
    dev = p.device if p is not None else torch.device("cpu")
    dtype = next((q.dtype for q in model.parameters() if q.is_floating_point()), torch.float32)
    return (), {k: v.to(dev, dtype) if v.is_floating_point() else v.to(dev) for k, v in kwargs.items()}
