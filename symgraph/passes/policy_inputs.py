"""Example inputs of a model that acts on what it sees (a vision-language-action policy: PI0), see
:mod:`.inputs`; built from the config and the forward's signature, never from the model's name:

- a main input that is a vector of a width the config states (``state`` of ``max_state_dim``,
  else ``state_dim``): random values;
- images one camera a row (``pixel_values`` of ``batch × 1 × C × H × W`` and
  ``pixel_attention_mask`` of ``batch × 1``, every camera present) where the forward takes both
  and its vision-language sub-model (the one module with ``get_image_features`` whose sub-config
  states an image token) embeds them: as many image tokens after each row's first token as that
  function returns features per image;
- inputs the forward draws at random where they are not given (``noise``, ``timestep``: a
  flow-matching policy samples both), fixed, so that the traced program is a function of its
  inputs: the noise of the shape the forward draws, one time in ``(0, 1)`` a row.
"""
from __future__ import annotations

import inspect

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .image_inputs import features_per_image
from .input_values import config_value, ints, pixels
from .optional_inputs import Trials

__all__ = ["camera_images", "drawn_inputs", "vector_main"]


def _int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def vector_main(cfg, name: str, batch: int, gen) -> torch.Tensor | None:
    """``batch`` random vectors of the width the config states for ``name``
    (``max_<name>_dim``, else ``<name>_dim``); None where it states none."""
    width = _int(getattr(cfg, f"max_{name}_dim", None)) or _int(getattr(cfg, f"{name}_dim", None))
    return torch.randn(batch, width, generator=gen) if width else None


def _vision_language(model):
    """``(module, its config)``: the one submodule with ``get_image_features`` whose config
    states an image token and a vision config; None unless exactly one."""
    found = [(m, m.config) for m in model.modules() if m is not model and callable(getattr(m, "get_image_features", None))
             and getattr(m, "config", None) is not None and getattr(m.config, "vision_config", None) is not None
             and ints(config_value(m.config, "image_token_id", "image_token_index"))]
    owners = {id(c) for _, c in found}
    return found[0] if len(owners) == 1 else None


def camera_images(model, kwargs: dict, batch: int, gen) -> None:
    """One camera a row and its image tokens (see the module's docstring), kept where the forward
    runs on them."""
    params = inspect.signature(model.forward).parameters
    ids = kwargs.get("input_ids")
    if not {"pixel_values", "pixel_attention_mask"} <= set(params) or "pixel_values" in kwargs \
            or not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return
    found = _vision_language(model)
    if found is None:
        return
    module, sub = found
    px = pixels(None, sub.vision_config, batch, gen)
    n = features_per_image(module, {"pixel_values": px}, batch)
    token = ints(config_value(sub, "image_token_id", "image_token_index"))[0]
    if n is None:
        return
    text = ids.masked_fill(ids == token, int(ids.min()) if int(ids.min()) != token else token + 1)
    image = torch.full((batch, n), token, dtype=ids.dtype)
    trial = {**kwargs, "input_ids": torch.cat([text[:, :1], image, text[:, 1:]], dim=1),
             "pixel_values": px.unsqueeze(1), "pixel_attention_mask": torch.ones(batch, 1, dtype=torch.bool)}
    trial.update(_drawn(model, trial, params, batch, gen))  # kept: :func:`drawn_inputs` then draws nothing
    if Trials(model, {}).reads(trial) is not None:
        kwargs.update(trial)


class _Draws(TorchDispatchMode):
    """Records the shapes of the normal draws (``randn``) of the ops it sees, and whether any op
    drew at random."""

    def __init__(self):
        super().__init__()
        self.normal: list[tuple] = []
        self.any = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.any = True
            if func.overloadpacket is torch.ops.aten.randn and isinstance(out, torch.Tensor):
                self.normal.append(tuple(out.shape))
        return out


def _drawn(model, kwargs: dict, params, batch: int, gen) -> dict:
    """``noise`` and ``timestep`` where the forward takes them, they are not given and it draws
    them (see the module's docstring); the forward runs once on ``kwargs`` to tell."""
    missing = [k for k in ("noise", "timestep") if k in params and k not in kwargs]
    if not missing:
        return {}
    draws = _Draws()
    with draws:
        Trials(model, {}).reads(kwargs)  # (a forward that fails after its draws has drawn)
    out = {}
    noise = next((s for s in draws.normal if s and s[0] == batch), None)
    if "noise" in missing and noise is not None:
        out["noise"] = torch.randn(*noise, generator=gen)
    if "timestep" in missing and draws.any:
        out["timestep"] = 0.1 + 0.8 * torch.rand(batch, generator=gen)
    return out


def drawn_inputs(model, kwargs: dict, batch: int, gen) -> None:
    """Fix the inputs the forward would draw at random (see the module's docstring)."""
    kwargs.update(_drawn(model, kwargs, inspect.signature(model.forward).parameters, batch, gen))
