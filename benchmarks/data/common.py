"""Constants, the cache directory and argument checks shared by the benchmark datasets (see
:mod:`benchmarks.data`)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

# the constants: the single place where data-side sizes live

#: Text corpora understood by :func:`corpus_text`.
TEXT_CORPORA = ("prose", "code")
#: Size of every BPE vocabulary, special tokens included.
VOCAB_SIZE = 512
PAD_TOKEN = "[PAD]"
MASK_TOKEN = "[MASK]"
#: Special tokens, in id order (so ``[PAD]`` is 0 and ``[MASK]`` is 1).
SPECIAL_TOKENS = (PAD_TOKEN, MASK_TOKEN)
PAD_ID = 0
MASK_ID = 1
#: Fraction of every dataset held out as the ``"eval"`` split.
EVAL_FRACTION = 0.1
#: Seed of the (model-independent) digits permutation used for splitting.
SPLIT_SEED = 1234
#: Maximum number of characters of standard-library source in ``"code"``.
CODE_MAX_CHARS = 1_000_000
#: BERT masking rate and the mask / random / keep proportions of masked tokens.
MLM_PROBABILITY = 0.15
MLM_MASK_FRACTION = 0.8
MLM_RANDOM_FRACTION = 0.1
NUM_DIGIT_CLASSES = 10
DIGIT_IMAGE_SIZE = 8
_DIGIT_MAX_VALUE = 16.0
#: Bump to invalidate cached tokenizers after a change in how they are built.
_TOKENIZER_VERSION = 1

_SPLITS = ("train", "eval")


def cache_dir() -> Path:
    """The benchmark suite's cache directory, absolute, created if needed: ``$SYMGRAPH_CACHE``
    (read at every call, so tests can redirect it), else ``~/.cache/symgraph``."""
    root = os.environ.get("SYMGRAPH_CACHE") or os.path.join("~", ".cache", "symgraph")
    path = Path(root).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def _check_split(split: str) -> None:
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")


def _check_corpus(corpus: str) -> None:
    if corpus not in TEXT_CORPORA:
        raise ValueError(f"corpus must be one of {TEXT_CORPORA}, got {corpus!r}")


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
