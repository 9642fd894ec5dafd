"""Tied parameters (one tensor under several names: GPT-2's head and embedding, shared layers)
kept tied where PyTorch would split them: ``Module.to`` on a device whose tensors cannot be
shallow-copied into the CPU parameter gives each name its own copy, and
``load_state_dict(assign=True)`` assigns each name its own tensor."""
from __future__ import annotations

import torch

__all__ = ["tied_groups", "retie", "to_device"]


def tied_groups(model: torch.nn.Module) -> list:
    """Groups of parameter names that share one tensor (each of two or more names)."""
    by_id: dict = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def retie(model: torch.nn.Module, groups) -> None:
    """Point every name of each group of ``groups`` at the first name's parameter."""
    for names in groups:
        first = model.get_parameter(names[0])
        for name in names[1:]:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, attr, first)


def to_device(model: torch.nn.Module, device) -> torch.nn.Module:
    """``model.to(device)`` with its tied parameters still tied."""
    groups = tied_groups(model)
    model = model.to(device)
    retie(model, groups)
    return model
