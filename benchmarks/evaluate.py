"""Losses, held-out evaluation and tracing inputs for the zoo models.

One loss, from the logits, for training, evaluation and curves: cross-entropy on BERT's masked
positions (labels != -100), on the next token (GPT-2, LLaMA), of the 10 digit classes (ViT).
Metrics: perplexity ``exp(loss)`` for language models, accuracy for the ViT. Evaluation batches
are deterministic: consecutive token blocks of the held-out split (BERT masks drawn with the
fixed seed :data:`EVAL_MASK_SEED`), or the held-out images in order, :data:`EVAL_BATCH_SIZE` a
batch. Losses are token- (image-) weighted over all batches used.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from . import data, zoo

EVAL_BATCH_SIZE = 32
EVAL_MASK_SEED = 0

#: A batch: ``{"input_ids", "labels"}`` for LMs (the MLM targets for BERT, ``input_ids`` for
#: causal LMs) or ``{"pixel_values", "labels"}`` for the ViT.
Batch = dict[str, torch.Tensor]


@functools.lru_cache(maxsize=None)
def _all_eval_batches(arch: str, split: str) -> tuple[Batch, ...]:
    spec = zoo.get_spec(arch)
    if spec.task == "cls":
        inputs, labels = data.digits(split)
    else:
        inputs = labels = data.token_blocks(spec.dataset, split, spec.block_size)
        if spec.task == "mlm":
            inputs, labels = data.mlm_mask(inputs, EVAL_MASK_SEED)
    n = EVAL_BATCH_SIZE
    return tuple({input_key(arch): inputs[i:i + n], "labels": labels[i:i + n]} for i in range(0, len(labels), n))


def eval_batches(arch: str, split: str = "eval", max_batches: int | None = None) -> list[Batch]:
    """The first ``max_batches`` (None: all) deterministic evaluation batches of ``arch`` on
    ``split`` ("eval"; "train": the same layout on the training data); shared tensors."""
    batches = _all_eval_batches(arch, split)
    return list(batches if max_batches is None else batches[:max_batches])


def model_logits(model: torch.nn.Module, arch: str, batch: Batch) -> torch.Tensor:
    """``model``'s logits on ``batch`` (moved to its device; decoders with ``use_cache=False``)."""
    device = next(model.parameters()).device
    task = zoo.get_spec(arch).task
    if task == "cls":
        return model(pixel_values=batch["pixel_values"].to(device)).logits
    return model(input_ids=batch["input_ids"].to(device), **({"use_cache": False} if task == "clm" else {})).logits


def _loss_sum(logits: torch.Tensor, arch: str, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    labels = labels.to(logits.device)
    if zoo.get_spec(arch).task == "clm":
        logits, labels = logits[:, :-1], labels[:, 1:]
    labels = labels.reshape(-1)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels, ignore_index=-100, reduction="sum")
    return loss, int((labels != -100).sum())


def batch_loss(model: torch.nn.Module, arch: str, batch: Batch) -> torch.Tensor:
    """``model``'s mean loss on one batch (differentiable)."""
    total, count = _loss_sum(model_logits(model, arch, batch), arch, batch["labels"])
    return total / max(count, 1)


def _evaluate(model: torch.nn.Module, arch: str, batches: list[Batch]) -> tuple[float, float]:
    """(mean loss, accuracy) over ``batches`` in eval mode, no grad; the mode restored."""
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
    """``model``'s mean loss in nats on :func:`eval_batches` ``(arch, split, max_batches)``."""
    return _evaluate(model, arch, eval_batches(arch, split, max_batches))[0]


def input_key(arch: str) -> str:
    return "pixel_values" if zoo.get_spec(arch).task == "cls" else "input_ids"


def metric_name(arch: str) -> str:
    return "accuracy" if zoo.get_spec(arch).task == "cls" else "perplexity"


def higher_is_better(arch: str) -> bool:
    return metric_name(arch) == "accuracy"


def eval_metric(model: torch.nn.Module, arch: str, split: str = "eval", max_batches: int | None = None) -> float:
    """``model``'s task metric on the batches of :func:`eval_loss`."""
    loss, accuracy = _evaluate(model, arch, eval_batches(arch, split, max_batches))
    return accuracy if metric_name(arch) == "accuracy" else math.exp(loss)


def loss_fn_for(arch: str, split: str = "eval", max_batches: int | None = 4):
    """``f(model) -> float``: :func:`eval_loss` on batches fixed now (every point of a curve scored
    on the same data); ``max_batches`` None: the whole split."""
    batches = eval_batches(arch, split, max_batches)
    return lambda model: _evaluate(model, arch, batches)[0]


def example_inputs(arch: str, batch_size: int = 2) -> tuple[torch.Tensor, ...]:
    """A small real batch of positional inputs for tracing ``arch``: ``(input_ids,)`` (masked for
    BERT) or ``(pixel_values,)``."""
    return (eval_batches(arch, "eval", 1)[0][input_key(arch)][:batch_size].clone(),)


@functools.lru_cache(maxsize=None)
def baseline_loss(arch: str, split: str = "eval") -> float:
    """The loss in nats of the best input-independent predictor on ``split``'s targets, a
    "learned anything?" bar: the add-one-smoothed unigram distribution of the training tokens
    (LMs), the training class frequencies (ViT)."""
    spec = zoo.get_spec(arch)
    if spec.task == "cls":
        targets, n_classes = data.digits("train")[1], data.NUM_DIGIT_CLASSES
    else:
        targets, n_classes = data.token_ids(spec.dataset, "train"), data.VOCAB_SIZE
    counts = torch.bincount(targets, minlength=n_classes).double() + 1.0
    log_p = (counts / counts.sum()).log()
    total, count = 0.0, 0
    for batch in eval_batches(arch, split):
        labels = batch["labels"][:, 1:] if spec.task == "clm" else batch["labels"]
        labels = labels[labels != -100]
        total += float(-log_p[labels].sum())
        count += labels.numel()
    return total / count
