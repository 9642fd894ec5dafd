"""Offline datasets for the symgraph benchmark suite.

Everything here is built from data that ships with Python or with the installed
packages, so the benchmarks never touch the network:

``"prose"``
    English prose: the values of :data:`pydoc_data.topics.topics` (the text of
    the Python language reference used by ``help()``), concatenated in sorted
    key order.
``"code"``
    Python source: the top-level ``.py`` files of the standard-library
    directory (the directory of ``os.__file__``), read in sorted file-name order
    and truncated to :data:`CODE_MAX_CHARS` characters.
``"digits"``
    :func:`sklearn.datasets.load_digits`: 1797 grey-scale 8x8 images of the
    digits 0-9, pixel values 0..16.

Splits
------
Text corpora are split *by characters* before tokenisation: the last
:data:`EVAL_FRACTION` of the text (moved forward to the next line break) is the
held-out ``"eval"`` split and the rest is ``"train"``. The tokenizer is trained
on the train split only. Digits are permuted once with the fixed seed
:data:`SPLIT_SEED` and the last :data:`EVAL_FRACTION` of that permutation is
held out. Splits never depend on a model's training seed.

Tokenizers
----------
One byte-level BPE tokenizer (Hugging Face ``tokenizers``) per text corpus,
:data:`VOCAB_SIZE` entries including the special tokens ``[PAD]`` (id 0) and
``[MASK]`` (id 1). Byte-level BPE round-trips any string exactly. Trained
tokenizers are cached as JSON under ``<cache_dir()>/tokenizers`` with a
fingerprint of the training text in the file name, and memoised in-process.

Images
------
Digits are returned as float32 tensors of shape ``(n, 1, 8, 8)`` (one channel,
native 8x8 resolution, no resizing), scaled from 0..16 to [-1, 1]. The ViT in
:mod:`benchmarks.zoo` uses ``patch_size=2``, i.e. 16 patches of 2x2 pixels.
"""

from __future__ import annotations

import functools
import hashlib

import numpy as np

# the datasets live in sibling modules, one seam each; this module re-exports them under the
# names the rest of the suite has always used
from .common import (CODE_MAX_CHARS, DIGIT_IMAGE_SIZE, EVAL_FRACTION, MASK_ID, MASK_TOKEN,  # noqa: F401
                     MLM_MASK_FRACTION, MLM_PROBABILITY, MLM_RANDOM_FRACTION, NUM_DIGIT_CLASSES, PAD_ID, PAD_TOKEN,
                     SPECIAL_TOKENS, SPLIT_SEED, TEXT_CORPORA, VOCAB_SIZE, _check_corpus, _sha, cache_dir)
from .images import _digits_cached, digits  # noqa: F401
from .text import corpus_text, split_text  # noqa: F401
from .tokens import get_tokenizer, mlm_mask, random_blocks, token_blocks, token_ids  # noqa: F401

__all__ = ["TEXT_CORPORA", "VOCAB_SIZE", "PAD_TOKEN", "MASK_TOKEN", "PAD_ID", "MASK_ID", "SPECIAL_TOKENS",
           "EVAL_FRACTION", "SPLIT_SEED", "MLM_PROBABILITY", "NUM_DIGIT_CLASSES", "DIGIT_IMAGE_SIZE", "cache_dir",
           "corpus_text", "split_text", "get_tokenizer", "token_ids", "token_blocks", "random_blocks", "mlm_mask",
           "digits", "data_fingerprint"]


@functools.lru_cache(maxsize=None)
def data_fingerprint(dataset: str) -> str:
    """12 hexadecimal characters naming the exact contents of ``dataset`` ("prose", "code" or
    "digits"): in cache keys, so that checkpoints trained on another Python installation (another
    standard library or ``pydoc`` text) are never silently reused."""
    if dataset == "digits":
        x, y, perm = _digits_cached()
        h = hashlib.sha256()
        for arr in (x.numpy(), y.numpy(), perm):
            h.update(np.ascontiguousarray(arr).tobytes())
        return h.hexdigest()[:12]
    _check_corpus(dataset)
    return _sha(f"{VOCAB_SIZE}|{EVAL_FRACTION}|{corpus_text(dataset)}")[:12]
