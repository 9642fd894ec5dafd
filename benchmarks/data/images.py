"""The scikit-learn digits images, split by a fixed permutation (see :mod:`benchmarks.data`)."""

from __future__ import annotations

import functools

import numpy as np
import torch

from .common import _DIGIT_MAX_VALUE, DIGIT_IMAGE_SIZE, EVAL_FRACTION, SPLIT_SEED, _check_split


@functools.lru_cache(maxsize=None)
def _digits_cached() -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
    from sklearn.datasets import load_digits

    bunch = load_digits()
    images = bunch.images.astype(np.float32) / _DIGIT_MAX_VALUE * 2.0 - 1.0
    x = torch.from_numpy(images).reshape(-1, 1, DIGIT_IMAGE_SIZE, DIGIT_IMAGE_SIZE)
    y = torch.from_numpy(bunch.target.astype(np.int64))
    perm = np.random.default_rng(SPLIT_SEED).permutation(len(y))
    return x, y, perm


def digits(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(images (n, 1, 8, 8) in [-1, 1], labels (n,) in 0..9)`` of one split of the scikit-learn
    digits, shaped for a ViT: "eval" is the last :data:`EVAL_FRACTION` (rounded up) of a fixed
    permutation (seed :data:`SPLIT_SEED`), "train" the rest."""
    _check_split(split)
    x, y, perm = _digits_cached()
    n_eval = int(np.ceil(len(perm) * EVAL_FRACTION))
    idx = perm[: len(perm) - n_eval] if split == "train" else perm[len(perm) - n_eval :]
    idx = torch.from_numpy(np.sort(idx))
    return x[idx].clone(), y[idx].clone()
