"""Training-only parameters (issue 65): a parameter that a module reads only in training mode
(``if self.training``): a detection model's denoising embedding, read only on the training
path's contrastive denoising queries (built from the ``labels``: DN-DETR, Li et al. 2022;
RT-DETR, Zhao et al. 2024), a decoder's per-layer heads scored only for the auxiliary losses,
Group DETR's extra query groups (Chen et al. 2023). A parameter the traced program never reads
fixes every class, so the trace also runs the module in training mode.

Which module is found by trial runs that observe the parameters read
(:func:`.optional_inputs.parameter_reads`), never by names: for an unread parameter, each
module above it (nearest first; torch's own modules and the containers excluded: a norm's
batch statistics are another function) whose forward's source reads ``self.training``; each
tried with its own ``training`` flag set (only its own: its children stay in eval mode, so
dropout stays off) and, where its forward takes ``labels: list[dict] | None`` (the detection
targets of transformers: ``class_labels`` and ``boxes``) and the call left them unset, on
labels built from the config (:func:`detection_labels`; never the model's own labels, which ask
for its loss). Kept where the run reads a parameter
that was unread and returns a finite result (:data:`MAX_TRIALS` trials at most).

In the program the module runs again beside its call, in training mode, under a fixed random
generator (:data:`SEED`: the denoising queries' label and box noise are the same draws in every
run, the certificate's included; in the graph they stay random ops, which depend on no
parameter or input, so no rule reads them), and ``0 * s`` is added to each floating tensor of
its output (the run is live wherever the output reaches a kept one), ``s`` the sum of the run's results (its floating outputs but those named as
hidden states, :data:`.nodes.HIDDEN_OUTPUTS`, as the model's own outputs are chosen) each times
a constant that varies along every axis: the program computes the plain eval forward, which its
consumers run on a user's batch, and the analysis keeps every axis of those results fixed, as
if they were outputs. :func:`symgraph.report.certify.certify` checks them.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .closed_reads import proven_dead
from .entry_points import varying_sum
from .input_values import config_value
from .nodes import HIDDEN_OUTPUTS
from .optional_inputs import float_leaves, forward_hooks, modules_above, parameter_reads

__all__ = ["TrainingRun", "training_runs", "trained", "training_results", "detection_labels",
           "MAX_TRIALS", "SEED"]

MAX_TRIALS = 8  # trial runs at most per trace (each one runs the whole forward)
SEED = 0  # the random generator's seed for every training run


@dataclass(frozen=True)
class TrainingRun:
    """The module at ``path`` run again in training mode, on labels built from the config
    where ``labels``."""
    path: str
    labels: bool = False


def takes_labels(module) -> bool:
    """Whether ``module.forward`` takes detection targets: ``labels``, default None, annotated
    as a list of dicts."""
    try:
        p = inspect.signature(module.forward).parameters.get("labels")
    except (TypeError, ValueError):
        return False
    return p is not None and p.default is None and "list[dict" in str(p.annotation).replace(" ", "")


def detection_labels(config, batch: int, device) -> list | None:
    """Two objects an image: class ids below the config's ``num_labels``, boxes as
    ``(center x, center y, width, height)`` in ``(0, 1)``; None where the config gives no
    ``num_labels``."""
    n = config_value(config, "num_labels")
    if not isinstance(n, int) or n < 1:
        return None
    boxes = torch.tensor([[0.3, 0.4, 0.2, 0.3], [0.6, 0.55, 0.3, 0.25]], device=device)
    return [{"class_labels": torch.arange(b, b + 2, device=device) % n, "boxes": boxes.clone()}
            for b in range(batch)]


def _gates(module) -> bool:
    """Whether ``module`` is one a training run may set (see the module's docstring)."""
    cls = type(module)
    if cls.__module__.split(".")[0] == "torch":
        return False
    try:
        return "self.training" in inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False


def _results(out) -> list:
    """The floating tensors of ``out`` but those under a field named as hidden states."""
    if hasattr(out, "items"):
        return [t for k, v in out.items() if not (isinstance(k, str) and k.endswith(HIDDEN_OUTPUTS))
                for t in float_leaves(v)]
    return float_leaves(out)


@contextlib.contextmanager
def _training(module):
    """``module`` (alone) in training mode, under the fixed generator, while inside."""
    flag, dev = module.training, next((p.device for p in module.parameters()), torch.device("cpu"))
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(SEED)
        module.training = True
        try:
            yield
        finally:
            module.training = flag


class _Hook:
    """The forward hook running its module again in training mode (see the module's
    docstring); ``values`` holds the last run's results. ``busy`` is shared by the hooks of one
    :func:`trained`: a run inside another's runs no third."""

    def __init__(self, run: TrainingRun, busy: list):
        self.run, self.busy, self.values = run, busy, None

    def __call__(self, module, args, kwargs, out):
        if self.busy:
            return None
        kwargs = dict(kwargs)
        if self.run.labels:
            if kwargs.get("labels") is not None:
                return None
            main = float_leaves((args, kwargs))
            cfg = getattr(module, "config", None)
            labels = detection_labels(cfg, main[0].shape[0], main[0].device) if main and cfg is not None else None
            if labels is None:
                return None
            kwargs["labels"] = labels
        self.busy.append(True)
        try:
            with _training(module):
                self.values = _results(module(*args, **kwargs))
        finally:
            self.busy.clear()
        return _joined(out, self.values)


def _joined(out, extra: list):
    """``out`` with ``0 * s`` added to each of its floating tensors (see the module's
    docstring: to each, so that the run is live wherever one of them reaches a kept output);
    None where it has none."""
    leaves, spec = tree_flatten(out)
    floats = [i for i, t in enumerate(leaves) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats or not extra:
        return None
    s = varying_sum(extra)
    for i in floats:
        leaves[i] = leaves[i] + 0 * s.to(leaves[i].dtype)
    return tree_unflatten(leaves, spec)


@contextlib.contextmanager
def trained(model, runs):
    """While inside, each of ``runs`` runs its module of ``model`` again in training mode
    beside its call (see the module's docstring); yields the hooks."""
    busy: list = []
    hooks = [_Hook(r, busy) for r in runs]
    with forward_hooks(model, [(h.run.path, h) for h in hooks]):
        yield hooks


def training_results(model, run: TrainingRun, args, kwargs) -> list:
    """The results of ``run`` on ``model`` run on ``args``/``kwargs`` as the program runs it
    (:func:`symgraph.report.certify.certify` compares them); empty where its module was not
    called or the run was not made."""
    with trained(model, [run]) as hooks:
        model(*args, **kwargs)
    return hooks[0].values or []


def _candidates(model, unread: list[str]) -> list[TrainingRun]:
    """The runs tried, in order (see the module's docstring)."""
    out = []
    for path in modules_above(unread):
        module = model.get_submodule(path)
        if _gates(module):
            out.append(TrainingRun(path))
            if path and takes_labels(module):  # the model's own labels ask for its loss
                out.append(TrainingRun(path, labels=True))
    return out


def _tried(model, run: TrainingRun, args, kwargs) -> frozenset | None:
    """The parameters read with ``run`` made, where its results are finite and some; else None."""
    with trained(model, [run]) as hooks:
        reads = parameter_reads(model, args, kwargs)
    values = hooks[0].values
    if reads is None or not values or not all(t.is_meta or bool(torch.isfinite(t).all()) for t in values):
        return None
    return reads


def training_runs(model, args, kwargs, unread: list[str]) -> list[TrainingRun]:
    """The training runs that read the parameters the forward on ``args``/``kwargs`` leaves
    ``unread`` (see the module's docstring); none where one stays unread after them and is not
    proven dead (:func:`.closed_reads.proven_dead`): it fixes every class anyway, and the program would grow
    for nothing. RF-DETR's mask token, which transformers' own forward cannot read, is proven
    dead (:mod:`.closed_reads`): its Group DETR groups' runs are kept."""
    kept: list[TrainingRun] = []
    left, budget = set(unread), MAX_TRIALS
    tensors = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}
    for run in _candidates(model, unread):
        if not left or budget <= 0:
            break
        if any(k.path == run.path for k in kept):
            continue
        budget -= 1
        reads = _tried(model, run, args, kwargs)
        read = {tensors.get(n, n) for n in reads or ()}  # a tied tensor: read under each name
        if reads is not None and any(tensors.get(n, n) in read for n in left):
            kept.append(run)
            left = {n for n in left if tensors.get(n, n) not in read}
    if left and set(proven_dead(model, sorted(left))) != left:
        return []
    return kept
