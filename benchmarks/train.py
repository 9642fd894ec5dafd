"""Training and checkpoint caching for the zoo models.

:func:`train_model` trains ``arch`` from seed ``seed`` with AdamW (linear warm-up, cosine decay
to 10% of the peak rate, weight decay on matrices only, gradient clipping; the loop is
:func:`symgraph.testing.models.train`) and caches the result. The seed fixes both the
initialisation (:func:`benchmarks.zoo.build_model`) and the data order (a ``torch.Generator``
seeded with ``seed + DATA_SEED_OFFSET`` draws the training blocks / images and the dynamic BERT
masks), so a given (arch, size, seed, steps) is reproducible on a given machine and thread count.

Cache: ``<root>/models/<arch>-<size>-seed<seed>-steps<steps>-<fingerprint>/`` (root
``$SYMGRAPH_CACHE``, default ``~/.cache/symgraph``) holds ``config.json``, ``model.safetensors``
and ``training_info.json``. The fingerprint hashes everything else that determines the weights
(spec setting, model config, data contents, optimiser settings, :data:`CACHE_VERSION`), so a
changed spec table or Python installation never reuses a stale checkpoint.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import time
from pathlib import Path

import torch

from symgraph.testing import models

from . import data, evaluate, zoo
from .provenance import staged

#: Bump to invalidate every cached checkpoint.
CACHE_VERSION = 1
#: Offset between the initialisation seed and the data-order seed.
DATA_SEED_OFFSET = 10_000
WARMUP_FRACTION = 0.05
MIN_LR_FRACTION = 0.1
WEIGHT_DECAY = 0.01
ADAM_BETAS = (0.9, 0.98)
GRAD_CLIP = 1.0
#: The optimiser settings above as they enter every cache key.
OPTIM = [WARMUP_FRACTION, MIN_LR_FRACTION, WEIGHT_DECAY, list(ADAM_BETAS), GRAD_CLIP, DATA_SEED_OFFSET]
_INFO_FILE = "training_info.json"


def num_threads() -> int:
    """Torch threads for training: ``$SYMGRAPH_NUM_THREADS``, default 2."""
    return int(os.environ.get("SYMGRAPH_NUM_THREADS", 2))


@contextlib.contextmanager
def _no_progress_bars():
    """Silence the Hugging Face per-shard save / load progress bars."""
    from transformers.utils import logging as hf_logging
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _fingerprint(arch: str, size: str) -> str:
    spec = zoo.get_spec(arch)
    payload = {
        "version": CACHE_VERSION, "family": spec.family, "task": spec.task, "dataset": spec.dataset,
        "data": data.data_fingerprint(spec.dataset), "block_size": spec.block_size,
        "setting": {k: v for k, v in dataclasses.asdict(spec.setting(size)).items() if k != "steps"},
        "config": {k: v for k, v in zoo.make_config(arch, size).to_dict().items() if k != "transformers_version"},
        "extra": dict(spec.extra), "optim": OPTIM,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()[:10]


def checkpoint_dir(arch: str, seed: int, size: str = "quick", steps: int | None = None) -> Path:
    """The cache directory of ``arch`` trained from ``seed`` at ``size`` for ``steps`` (None: the
    spec's); it may not exist."""
    steps = zoo.get_setting(arch, size).steps if steps is None else int(steps)
    return data.cache_dir() / "models" / f"{arch}-{size}-seed{seed}-steps{steps}-{_fingerprint(arch, size)}"


def is_cached(arch: str, seed: int, size: str = "quick", steps: int | None = None) -> bool:
    return (checkpoint_dir(arch, seed, size, steps) / _INFO_FILE).is_file()


def training_info(arch: str, seed: int, size: str = "quick", steps: int | None = None) -> dict:
    """The ``training_info.json`` of a cached checkpoint: ``train_seconds`` (wall),
    ``train_cpu_seconds``, ``init_eval_loss``, ``eval_loss``, ``final_train_loss`` (mean of the
    last 10% of steps) and the key fields."""
    return json.loads((checkpoint_dir(arch, seed, size, steps) / _INFO_FILE).read_text())


def batch_sampler(spec: zoo.ModelSpec, batch_size: int, gen: torch.Generator):
    """A no-argument callable drawing training batches from ``gen``."""
    if spec.task == "cls":
        x, y = data.digits("train")

        def sample() -> evaluate.Batch:
            idx = torch.randint(0, len(y), (batch_size,), generator=gen)
            return {"pixel_values": x[idx], "labels": y[idx]}
        return sample

    def sample() -> evaluate.Batch:
        blocks = data.random_blocks(spec.dataset, "train", spec.block_size, batch_size, gen)
        if spec.task == "mlm":
            inputs, labels = data.mlm_mask(blocks, generator=gen)
            return {"input_ids": inputs, "labels": labels}
        return {"input_ids": blocks, "labels": blocks}
    return sample


def fit(model: torch.nn.Module, sample, steps: int, lr: float, **kw) -> list[float]:
    """:func:`symgraph.testing.models.train` of ``model`` in place with the suite's optimiser
    (AdamW, weight decay on matrices, clipping, warm-up cosine to ``MIN_LR_FRACTION`` of ``lr``)
    on ``sample()``'s batches; ``kw``: its other arguments. The per-step training losses."""
    return models.train(model, sample, steps=steps, lr=lr, weight_decay=WEIGHT_DECAY, betas=ADAM_BETAS,
                        grad_clip=GRAD_CLIP, schedule=models.warmup_cosine(steps, WARMUP_FRACTION, MIN_LR_FRACTION),
                        **kw)


def _fit(model: torch.nn.Module, arch: str, size: str, seed: int, steps: int, verbose: bool) -> list[float]:
    """Train ``model`` in place; the per-step training losses."""
    spec = zoo.get_spec(arch)
    setting = spec.setting(size)
    gen = torch.Generator().manual_seed(seed + DATA_SEED_OFFSET)
    every = max(1, steps // 5)

    def report(step: int, loss: float, _elapsed: float) -> None:
        if verbose and step % every == 0:
            print(f"  [{arch} seed={seed}] step {step}/{steps} loss {loss:.3f}", flush=True)

    return fit(model, batch_sampler(spec, setting.batch_size, gen), steps, setting.lr,
               loss_fn=lambda m, batch: evaluate.batch_loss(m, arch, batch), progress=report)


def save_atomically(model: torch.nn.Module, info: dict, final: Path) -> None:
    """``model`` and its ``info`` into ``final``, staged (:func:`benchmarks.provenance.staged`):
    ``training_info.json``, moved in last, marks a whole checkpoint."""
    with staged(final, prefix=f".tmp-{final.name}-") as tmp, _no_progress_bars():
        model.save_pretrained(str(tmp), safe_serialization=True)
        (tmp / _INFO_FILE).write_text(json.dumps(info, indent=2, sort_keys=True))


def train_model(arch: str, seed: int, size: str = "quick", steps: int | None = None, *, use_cache: bool = True,
                verbose: bool = False) -> torch.nn.Module:
    """``arch`` at ``size`` trained from ``seed`` for ``steps`` AdamW steps (None: the spec's), in
    ``eval()`` mode (float32, CPU): from the cache if there, else trained and written to it
    (``use_cache`` False: always trained, never written; ``verbose``: progress printed)."""
    steps = zoo.get_setting(arch, size).steps if steps is None else int(steps)
    path = checkpoint_dir(arch, seed, size, steps)
    if use_cache and (path / _INFO_FILE).is_file():
        with _no_progress_bars():
            model = zoo.model_class(arch).from_pretrained(str(path), attn_implementation=zoo.ATTN_IMPLEMENTATION,
                                                          dtype=torch.float32)
        return model.eval()
    record = use_cache or verbose  # the held-out losses only go to the info file / log
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(num_threads())
    try:
        model = zoo.build_model(arch, seed, size)
        init_loss = evaluate.eval_loss(model, arch) if record else float("nan")
        start, cpu_start = time.perf_counter(), time.process_time()
        losses = _fit(model, arch, size, seed, steps, verbose)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        final_loss = evaluate.eval_loss(model, arch) if record else float("nan")
    finally:
        torch.set_num_threads(previous_threads)
    tail = losses[-max(1, steps // 10):] if losses else [float("nan")]
    info = {"arch": arch, "size": size, "seed": seed, "steps": steps, "train_seconds": seconds,
            "train_cpu_seconds": cpu_seconds, "init_eval_loss": init_loss, "eval_loss": final_loss,
            "final_train_loss": sum(tail) / len(tail), "num_parameters": sum(p.numel() for p in model.parameters()),
            "num_threads": num_threads(), "cache_version": CACHE_VERSION}
    if verbose:
        print(f"  [{arch} seed={seed}] {seconds:.1f}s eval loss {init_loss:.3f} -> {final_loss:.3f}", flush=True)
    if use_cache:
        save_atomically(model, info, path)
    return model
