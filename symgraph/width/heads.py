"""A model class built with heads ``n`` times as wide, which its config states: the circuit-space
model (:mod:`symgraph.merging.circuits`) of an architecture whose config holds a head size
(``head_dim``: LLaMA, Qwen2, Mistral, Gemma...). The config says the new head size and keeps
every RoPE pair at its own frequency through per-pair factors (``longrope``-type rope
parameters, attention factor 1); the model is built with empty tensors to write into, its tied
names tied again and the buffers its config computes rebuilt once they are written. Where no
config field can state the head size (GPT-2 derives it from the width), :mod:`.widen` widens
the model's traced program instead.
"""
from __future__ import annotations

import copy

import torch

from ..core.devices import meta_model
from ..core.ties import retie, tied_groups
from ..errors import InputError

__all__ = ["why_no_config", "check_config", "wide_config", "wide_model"]


def why_no_config(model, n) -> str | None:
    """Why ``model``'s config cannot state ``n``-fold heads, or None where it can."""
    cfg = getattr(model, "config", None)
    if cfg is None or "head_dim" not in cfg.to_dict():
        name = type(cfg).__name__ if cfg is not None else type(model).__name__
        return (f"{name} has no head_dim field (its head size is derived from the width), so a checkpoint "
                f"cannot state the {n}x wider circuit-space heads; the merged model runs in memory only")
    return None


def check_config(model, n) -> None:
    """Refuse circuit-space heads of ``n`` models like ``model`` for a saved checkpoint where
    :func:`why_no_config` says why its config cannot state them."""
    why = why_no_config(model, n)
    if why:
        raise InputError(f"{why} (symgraph.merge(..., attention='circuits') in Python); expected a config "
                         "with head_dim (LLaMA, Qwen2, Mistral, Gemma...) for a saved checkpoint")


def wide_config(model, head_dim: int, n: int, rope: bool):
    """``model``'s config with heads ``n`` times as wide: head size ``n·head_dim`` (refused where
    the config's is not ``head_dim``), and with ``rope`` each RoPE pair at its own frequency."""
    cfg = copy.deepcopy(model.config)
    d, new = head_dim, head_dim * n
    if _head_dim(cfg) != d:
        raise InputError(f"{type(cfg).__name__} states heads {_head_dim(cfg)} wide but the report's are {d} wide; "
                         "expected a config whose head_dim (or width over heads, where head_dim is None) is the "
                         "attention's head size")
    if rope:
        rp = dict(cfg.rope_parameters or {})
        inv = _inv_freq(model, cfg, d)
        theta = float(rp.get("rope_theta", 10000.0))
        target = inv.repeat(n).double()  # pair j of the wide head: pair j mod d/2 of a model
        j = torch.arange(0, new, 2, dtype=torch.float64) / new
        factors = (1.0 / (target * theta ** j)).tolist()
        cfg.rope_parameters = {"rope_type": "longrope", "rope_theta": theta, "short_factor": factors,
                               "long_factor": factors, "factor": 1.0, "attention_factor": 1.0,
                               "original_max_position_embeddings": cfg.max_position_embeddings}
    cfg.head_dim = new
    return cfg


def _head_dim(cfg):
    """The head size ``cfg`` states: its ``head_dim``, or where that is None (Mixtral: the
    attention then takes ``hidden_size // num_attention_heads``) the width over the heads."""
    if cfg.head_dim is not None:
        return cfg.head_dim
    width, heads = getattr(cfg, "hidden_size", None), getattr(cfg, "num_attention_heads", None)
    return width // heads if isinstance(width, int) and isinstance(heads, int) and heads else None


def _inv_freq(model, cfg, d):
    """The parents' per-pair RoPE frequencies (``d/2``), from transformers' own rope setup."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    rp = cfg.rope_parameters or {}
    kind = rp.get("rope_type", "default")
    if kind == "default":
        theta = float(rp.get("rope_theta", 10000.0))
        if rp.get("partial_rotary_factor", 1.0) != 1.0:
            raise InputError("partial rotary heads are not supported by circuit-space export")
        return 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    inv, factor = ROPE_INIT_FUNCTIONS[kind](cfg, "cpu")
    if abs(float(factor) - 1.0) > 1e-12:
        raise InputError(f"rope_type {kind!r} scales attention by {factor}; circuit-space export keeps only "
                         "rope types with attention factor 1")
    return inv.double()


def wide_model(A, cfg, device):
    """``(model, finish)``: ``A``'s class built from the circuit-space ``cfg`` with empty tensors on
    ``device`` (tied names each their own until ``finish(model)``, run once every tensor is
    written, ties them again and rebuilds the buffers the config computes): what circuit-space
    merges write into (:mod:`symgraph.merging.circuits`)."""
    new = meta_model(type(A), cfg)
    tied = tied_groups(new)  # to_empty and load_state_dict(assign=True) give each tied name its own tensor
    new = new.to_empty(device=device)

    def finish(model):
        retie(model, tied)
        _recompute_buffers(model, cfg)
        model.eval()
    return new, finish


def _recompute_buffers(model, cfg):
    """Non-persistent buffers (RoPE frequencies) hold no saved value: rebuild the modules that
    own them from the new config, on the model's device."""
    dev = next(model.parameters()).device
    for name, mod in list(model.named_modules()):
        if not getattr(mod, "_non_persistent_buffers_set", None) or any(True for _ in mod.parameters(recurse=False)):
            continue
        fresh = type(mod)(config=cfg).to(dev)  # built on the CPU: its buffers are small
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, fresh)
