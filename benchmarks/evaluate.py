"""Losses, held-out evaluation and tracing inputs for the zoo models.

Losses are computed here from the logits (not by the Hugging Face heads) so
that training, evaluation and loss-barrier curves use one definition:

* ``mlm`` (BERT): cross-entropy on the masked positions only (labels != -100),
  averaged over masked tokens;
* ``clm`` (GPT-2, LLaMA): next-token cross-entropy, averaged over all predicted
  tokens (``block_size - 1`` per sequence);
* ``cls`` (ViT): cross-entropy of the 10-way digit classification, averaged over
  images.

Metrics (:func:`eval_metric`): perplexity ``exp(loss)`` for language models
(lower is better), accuracy in [0, 1] for the ViT (higher is better).

The evaluation batches are deterministic: consecutive non-overlapping token
blocks of the held-out split (BERT masks drawn with the fixed seed
:data:`EVAL_MASK_SEED`), or the held-out images in order, in batches of
:data:`EVAL_BATCH_SIZE`. Losses are token- (image-) weighted over all batches
used, so ``max_batches`` only trades accuracy for speed.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import torch
import torch.nn.functional as F

from . import data, zoo

__all__ = ["EVAL_BATCH_SIZE", "EVAL_MASK_SEED", "LOSS_FN_MAX_BATCHES", "Batch", "eval_batches", "model_logits",
           "batch_loss", "eval_loss", "eval_metric", "metric_name", "higher_is_better", "loss_fn_for",
           "example_inputs", "baseline_loss", "input_key"]

#: Sequences (images) per evaluation batch.
EVAL_BATCH_SIZE = 32
#: Seed of the fixed BERT masking of the evaluation data.
EVAL_MASK_SEED = 0
#: Default number of batches used by :func:`loss_fn_for` (cheap, for curves).
LOSS_FN_MAX_BATCHES = 4

#: A batch: ``{"input_ids", "labels"}`` for LMs (labels are the MLM targets
#: for BERT and equal to ``input_ids`` for causal LMs) or
#: ``{"pixel_values", "labels"}`` for the ViT.
Batch = dict[str, torch.Tensor]


@functools.lru_cache(maxsize=None)
def _all_eval_batches(arch: str, split: str) -> tuple[Batch, ...]:
    spec = zoo.get_spec(arch)
    batches: list[Batch] = []
    if spec.task == "cls":
        x, y = data.digits(split)
        for i in range(0, len(y), EVAL_BATCH_SIZE):
            batches.append({"pixel_values": x[i : i + EVAL_BATCH_SIZE], "labels": y[i : i + EVAL_BATCH_SIZE]})
        return tuple(batches)
    blocks = data.token_blocks(spec.dataset, split, spec.block_size)
    if spec.task == "mlm":
        inputs, labels = data.mlm_mask(blocks, EVAL_MASK_SEED)
    else:
        inputs, labels = blocks, blocks
    for i in range(0, len(blocks), EVAL_BATCH_SIZE):
        batches.append({"input_ids": inputs[i : i + EVAL_BATCH_SIZE], "labels": labels[i : i + EVAL_BATCH_SIZE]})
    return tuple(batches)


def eval_batches(arch: str, split: str = "eval", max_batches: int | None = None) -> list[Batch]:
    """The deterministic evaluation batches (:data:`Batch`, shared tensors: do not modify) of
    ``arch`` (a key of :data:`benchmarks.zoo.SPECS`, as everywhere here) on ``split`` ("eval";
    "train": the same layout on the training data), the first ``max_batches`` (None: all)."""
    batches = _all_eval_batches(arch, split)
    return list(batches if max_batches is None else batches[:max_batches])


def _device_of(model: torch.nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def model_logits(model: torch.nn.Module, arch: str, batch: Batch) -> torch.Tensor:
    """``model``'s logits on ``batch`` (moved to its device; decoders called with
    ``use_cache=False``): ``(batch, seq, vocab)`` for LMs, ``(batch, classes)`` for the ViT.
    ``model``: a zoo model of ``arch`` or anything so called that returns ``.logits``."""
    spec = zoo.get_spec(arch)
    device = _device_of(model)
    if spec.task == "cls":
        return model(pixel_values=batch["pixel_values"].to(device)).logits
    kwargs = {"use_cache": False} if spec.task == "clm" else {}
    return model(input_ids=batch["input_ids"].to(device), **kwargs).logits


def _loss_sum(logits: torch.Tensor, arch: str, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy and number of scored targets."""
    task = zoo.get_spec(arch).task
    labels = labels.to(logits.device)
    if task == "clm":
        logits, labels = logits[:, :-1], labels[:, 1:]
    logits = logits.reshape(-1, logits.shape[-1]).float()
    labels = labels.reshape(-1)
    count = int((labels != -100).sum())
    return F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"), count


def batch_loss(model: torch.nn.Module, arch: str, batch: Batch) -> torch.Tensor:
    """``model``'s mean loss on one batch (differentiable; the module docstring defines it per
    task)."""
    total, count = _loss_sum(model_logits(model, arch, batch), arch, batch["labels"])
    return total / max(count, 1)


def _evaluate(model: torch.nn.Module, arch: str, batches: list[Batch]) -> tuple[float, float]:
    """Return (mean loss, accuracy) over ``batches`` in eval mode, no grad."""
    was_training = model.training
    model.eval()
    loss_total, count, correct = 0.0, 0, 0
    try:
        with torch.no_grad():
            for batch in batches:
                logits = model_logits(model, arch, batch)
                total, n = _loss_sum(logits, arch, batch["labels"])
                loss_total += float(total)
                count += n
                if zoo.get_spec(arch).task == "cls":
                    correct += int((logits.argmax(-1).cpu() == batch["labels"]).sum())
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("no evaluation targets")
    return loss_total / count, correct / count


def eval_loss(model: torch.nn.Module, arch: str, split: str = "eval", max_batches: int | None = None) -> float:
    """``model``'s mean loss in nats on :func:`eval_batches` ``(arch, split, max_batches)``,
    token- (image-) weighted; its train/eval mode is restored."""
    return _evaluate(model, arch, eval_batches(arch, split, max_batches))[0]


def input_key(arch: str) -> str:
    """The name of ``arch``'s positional input in a :data:`Batch`: "pixel_values" or "input_ids"."""
    return "pixel_values" if zoo.get_spec(arch).task == "cls" else "input_ids"


def metric_name(arch: str) -> str:
    """Name of :func:`eval_metric` for ``arch``: "accuracy" or "perplexity"."""
    return "accuracy" if zoo.get_spec(arch).task == "cls" else "perplexity"


def higher_is_better(arch: str) -> bool:
    """Whether a larger :func:`eval_metric` is better for ``arch``."""
    return metric_name(arch) == "accuracy"


def eval_metric(model: torch.nn.Module, arch: str, split: str = "eval", max_batches: int | None = None) -> float:
    """``model``'s task metric on the batches of :func:`eval_loss`: accuracy in [0, 1] for the
    ViT, perplexity ``exp(eval_loss)`` for the language models."""
    loss, accuracy = _evaluate(model, arch, eval_batches(arch, split, max_batches))
    return accuracy if metric_name(arch) == "accuracy" else math.exp(loss)


def loss_fn_for(arch: str, split: str = "eval",
                max_batches: int | None = LOSS_FN_MAX_BATCHES) -> Callable[[torch.nn.Module], float]:
    """``f(model) -> float``: :func:`eval_loss` on batches fixed now (every model, e.g. each
    point of a loss-barrier curve, scored on the same data); ``max_batches`` None: the whole
    split."""
    batches = eval_batches(arch, split, max_batches)

    def loss_fn(model: torch.nn.Module) -> float:
        return _evaluate(model, arch, batches)[0]

    loss_fn.__name__ = f"loss_fn_{arch}_{split}"
    return loss_fn


def example_inputs(arch: str, batch_size: int = 2) -> tuple[torch.Tensor, ...]:
    """A small real batch of positional inputs for tracing ``arch``: ``(input_ids,)`` of shape
    ``(batch_size, block_size)`` (masked for BERT) or the ViT's ``(pixel_values,)``, ``(batch_size,
    1, 8, 8)``; call as ``model(*inputs)`` (decoders also with ``use_cache=False``)."""
    batch = eval_batches(arch, "eval", 1)[0]
    key = input_key(arch)
    if batch[key].shape[0] < batch_size:
        raise ValueError(f"batch_size must be <= {EVAL_BATCH_SIZE}")
    return (batch[key][:batch_size].clone(),)


@functools.lru_cache(maxsize=None)
def baseline_loss(arch: str, split: str = "eval") -> float:
    """The loss in nats of the best input-independent predictor on ``split``'s targets (those of
    :func:`eval_loss`), a "learned anything?" bar: the add-one-smoothed unigram distribution of
    the training tokens (LMs), the training class frequencies (ViT)."""
    spec = zoo.get_spec(arch)
    if spec.task == "cls":
        train_targets = data.digits("train")[1]
        n_classes = data.NUM_DIGIT_CLASSES
    else:
        train_targets = data.token_ids(spec.dataset, "train")
        n_classes = data.VOCAB_SIZE
    counts = torch.bincount(train_targets, minlength=n_classes).double() + 1.0
    log_p = (counts / counts.sum()).log()
    total, count = 0.0, 0
    for batch in eval_batches(arch, split):
        labels = batch["labels"]
        if spec.task == "clm":
            labels = labels[:, 1:]
        labels = labels[labels != -100]
        total += float(-log_p[labels].sum())
        count += labels.numel()
    return total / count
