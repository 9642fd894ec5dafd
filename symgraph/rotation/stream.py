"""Massive activations in the residual stream (Sun et al. 2024, "Massive Activations in Large
Language Models"; Dettmers et al. 2022, LLM.int8()): a few channels of the stream itself that
are large at every position. They survive folding the norm gains (a norm's input ``x`` keeps
them; ``x / rms(x)`` still has them, the gain is not where they live), and per-token activation
quantization of the normed input then crushes every other channel. A rotation of the stream
spreads them. Scaling stream channels is no symmetry under a norm, so such a model cannot be made
function-preservingly; :func:`with_massive_channels` writes the channels into the token embedding
(a model to be fine-tuned afterwards, so that it adapts) and :func:`norm_input_ratios` measures
them where the quantizer meets them: at the inputs of every norm the report folds.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass

import torch

from ..errors import InputError
from .classes import rotation_report

__all__ = ["Massive", "with_massive_channels", "norm_inputs", "norm_input_ratios", "channel_ratio"]


@dataclass
class Massive:
    """What :func:`with_massive_channels` returns: the new ``model``, the stream ``channels``
    made massive and the ``offset`` added to them (``factor`` × the embedding's RMS)."""
    model: torch.nn.Module
    channels: list
    offset: float


def with_massive_channels(model, channels: int = 4, factor: float = 30.0, seed: int = 0) -> Massive:
    """A copy of ``model`` whose token embedding (``get_input_embeddings``) has ``offset = factor
    × RMS(embedding)`` added to ``channels`` channels (drawn from ``seed``) of every row: the
    residual stream starts with that many massive channels at every position. The function
    changes (no norm lets a stream channel be scaled); the copy is meant to be trained on, the
    input is left untouched. A tied output head sees the same offset on every vocabulary row:
    every logit of a position moves by one amount, so the softmax does not change through it."""
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    weight = getattr(emb, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise InputError(f"{type(model).__name__} has no token embedding matrix to write massive channels into")
    width = weight.shape[1]
    if not 1 <= channels <= width or not factor > 0:
        raise InputError(f"channels={channels}, factor={factor}; expected 1 <= channels <= {width} and factor > 0")
    new = copy.deepcopy(model)
    table = new.get_input_embeddings().weight
    idx = torch.randperm(width, generator=torch.Generator().manual_seed(seed))[:channels].sort().values
    offset = factor * float(table.detach().double().pow(2).mean().sqrt())
    with torch.no_grad():
        table[:, idx] += offset
    return Massive(new, idx.tolist(), offset)


def channel_ratio(x: torch.Tensor) -> float:
    """The largest channel's RMS over the median channel's RMS (channels: the last dim, RMS over
    every other dim): how far the largest channel stands out."""
    rms = x.detach().double().reshape(-1, x.shape[-1]).pow(2).mean(0).sqrt()
    return float(rms.max() / rms.median().clamp(min=1e-30))


@contextlib.contextmanager
def norm_inputs(model, inputs=None, detach: bool = True):
    """Within the block, ``seen[gain]`` collects (appends) the input of every norm the rotation
    report of ``model`` folds, each flattened to ``[tokens, width]`` (the norm's module is the one
    that owns its gain); ``detach=False`` keeps the graph (a training term on them)."""
    _, report, _ = rotation_report(model, inputs=inputs)
    seen: dict = {}
    handles = []
    for gain in dict.fromkeys(f.gain for f in report.folds):
        try:
            mod = model.get_submodule(gain.rpartition(".")[0])
        except AttributeError:
            continue

        def hook(_m, args, key=gain):
            x = args[0].detach() if detach else args[0]
            seen.setdefault(key, []).append(x.reshape(-1, x.shape[-1]))
        handles.append(mod.register_forward_pre_hook(hook))
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def norm_input_ratios(model, run, inputs=None) -> dict:
    """``{norm gain: channel_ratio of its input}`` for every norm the rotation report of
    ``model`` folds (:func:`norm_inputs`), its inputs taken while ``run(model)`` runs (all of
    them pooled)."""
    with norm_inputs(model, inputs) as seen, torch.no_grad():
        run(model)
    return {k: channel_ratio(torch.cat(v)) for k, v in seen.items()}
