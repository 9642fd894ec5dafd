"""A model's train/eval flag changed as torch changes it, whatever the model's class overrides."""
from __future__ import annotations

import torch

__all__ = ["set_mode"]


def set_mode(model: torch.nn.Module, training: bool = True) -> torch.nn.Module:
    """``model.train(training)`` as ``torch.nn.Module`` does it: every module's flag, and each
    child's own ``train`` (by which a module drops what it caches in eval: LeViT's gathered
    attention biases). The model's own override is skipped: transformers (≥ 5.25) re-kernelizes
    a model loaded with Hub kernels on every change of mode, swapping layers' forwards and
    refusing a device the kernels library does not know."""
    return torch.nn.Module.train(model, training)
