"""Inputs of a model that continues another model's computation (see :mod:`.inputs`): a draft
model for assisted decoding whose forward takes the target model's key/value states
(``shared_kv_states``) and its hidden states (``inputs_embeds``) in place of token ids (Gemma 4's
assistant: every layer attends to the shared states, with no key or value projection of its
own, and refuses to run without them).

- ``shared_kv_states``: ``{layer type: (keys, values)}``, one pair per type of the text config's
  ``layer_types``, each ``(batch, key/value heads, positions, head width)`` as the model's own
  attention modules of that type read them (their ``head_dim``; their query heads over their
  ``num_key_value_groups``), over as many positions as the token ids;
- ``inputs_embeds``: as wide as the first linear layer the forward applies to them directly
  (found by a trial run that stops there; a forward that normalises them first takes the text
  width).

Nothing is added where the forward does not take both, where no attention module states its
layer type, or where the forward still refuses the inputs."""
from __future__ import annotations

import torch
from torch.utils._pytree import tree_map

from .input_values import device_of

__all__ = ["shared_states"]


class _Stop(Exception):
    """Raised by the probe once the first linear layer reading the embeddings is found."""


def shared_states(model, kwargs: dict, params, cfg, batch: int, gen) -> None:
    """Add ``inputs_embeds`` and ``shared_kv_states`` to ``kwargs`` (see the module's docstring)."""
    ids = kwargs.get("input_ids")
    if not {"shared_kv_states", "inputs_embeds"} <= set(params) or ids is None:
        return
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    states = _kv_states(model, text, batch, ids.shape[1], gen, dtype)
    width = getattr(text, "hidden_size", None)
    if not states or not isinstance(width, int):
        return
    embeds = torch.randn(batch, ids.shape[1], width, generator=gen).to(dtype)
    width = _first_linear_width(model, {**kwargs, "shared_kv_states": states}, embeds) or width
    trial = {**kwargs, "shared_kv_states": states,
             "inputs_embeds": torch.randn(batch, ids.shape[1], width, generator=gen).to(dtype)}
    try:
        with torch.no_grad():
            model(**_on(trial, device_of(model)))
    except Exception:  # noqa: BLE001 - the forward refuses them: nothing added
        return
    kwargs.update(trial)


def _kv_states(model, text, batch: int, seq: int, gen, dtype) -> dict:
    """``{layer type: (keys, values)}`` shaped as the attention modules of each type read them."""
    heads = getattr(text, "num_attention_heads", None)
    out = {}
    for kind in dict.fromkeys(getattr(text, "layer_types", None) or ()):
        mod = next((m for m in model.modules() if getattr(m, "layer_type", None) == kind
                    and isinstance(getattr(m, "head_dim", None), int)
                    and isinstance(getattr(m, "num_key_value_groups", None), int)), None)
        if mod is None or not isinstance(heads, int) or heads % mod.num_key_value_groups:
            return {}
        shape = (batch, heads // mod.num_key_value_groups, seq, mod.head_dim)
        out[kind] = tuple(torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    return out


def _first_linear_width(model, kwargs: dict, embeds) -> int | None:
    """The input width of the first ``nn.Linear`` the forward applies to ``embeds`` itself, else
    None (a trial run of the forward, stopped there)."""
    found: list = []

    def probe(mod, args):
        if args and isinstance(args[0], torch.Tensor) and args[0].shape[:-1] == embeds.shape[:-1] \
                and args[0].data_ptr() == moved.data_ptr():
            found.append(mod.in_features)
            raise _Stop

    dev = device_of(model)
    moved = embeds.to(dev)
    hooks = [m.register_forward_pre_hook(probe) for m in model.modules() if isinstance(m, torch.nn.Linear)]
    try:
        with torch.no_grad():
            model(**_on(kwargs, dev), inputs_embeds=moved)
    except Exception:  # noqa: BLE001 - _Stop, or a refusal of the text width: found or not
        pass
    finally:
        for h in hooks:
            h.remove()
    return found[0] if found else None


def _on(kwargs: dict, dev) -> dict:
    """``kwargs`` with every tensor, nested in tuples and dicts too, on ``dev``."""
    return tree_map(lambda v: v.to(dev) if isinstance(v, torch.Tensor) else v, kwargs)
