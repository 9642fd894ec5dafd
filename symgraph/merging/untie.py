"""Untying shared weights (Theus et al. 2025 clone GPT-2's ``lm_head`` before folding the final
norm): with its own head, the residual stream no longer has to map the vocabulary embedding
and the output projection by one shared element, so it admits its orthogonal maps. The
merged model then stores one more ``vocabulary × width`` matrix."""
from __future__ import annotations

import copy

import torch

from ..report.api import tied_parameters

__all__ = ["untie", "untie_checkpoint", "untie_config_updates"]


def untie(model):
    """A copy of ``model`` whose tied parameters are separate tensors (the first name of each
    tied group keeps the original; every other name gets a copy), with a config that says
    so (``tie_word_embeddings=False``), so that ``save_pretrained`` / ``from_pretrained`` keep
    them apart. ``model`` is left untouched."""
    out = copy.deepcopy(model)
    for names in tied_parameters(out):
        for name in names[1:]:
            parent, _, attr = name.rpartition(".")
            mod = out.get_submodule(parent) if parent else out
            setattr(mod, attr, torch.nn.Parameter(getattr(mod, attr).detach().clone(),
                                                  requires_grad=getattr(mod, attr).requires_grad))
    cfg = getattr(out, "config", None)
    for c in {id(x): x for x in (cfg, getattr(cfg, "get_text_config", lambda: None)())}.values():
        if c is not None and getattr(c, "tie_word_embeddings", False):
            c.tie_word_embeddings = False
    return out


def untie_checkpoint(ckpt):
    """A :class:`~symgraph.checkpoints.sharded.Checkpoint` read as its untied model, for the
    merge engine: its meta model :func:`untie` d, each untied name its own key (as
    ``save_pretrained`` of the untied model writes it), read from the tied group's stored
    tensor (:meth:`~symgraph.checkpoints.sharded.Checkpoint.untied`). ``ckpt`` is left untouched."""
    return ckpt.untied(untie(ckpt.model))


def untie_config_updates(config) -> dict:
    """The ``config.json`` fields :func:`untie` changes in ``config``: ``tie_word_embeddings``
    false where it is set, at the top and in a nested text config (``{"text_config":
    {"tie_word_embeddings": False}}``, a field of that nested config); none for ``None``."""
    out: dict = {}
    if config is None:
        return out
    if getattr(config, "tie_word_embeddings", False):
        out["tie_word_embeddings"] = False
    text = getattr(config, "get_text_config", lambda: None)()
    if text is not None and text is not config and getattr(text, "tie_word_embeddings", False):
        field = next((k for k, v in vars(config).items() if v is text), None)
        if field is not None:
            out[field] = {"tie_word_embeddings": False}
    return out

