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
import os
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "TEXT_CORPORA",
    "VOCAB_SIZE",
    "PAD_TOKEN",
    "MASK_TOKEN",
    "PAD_ID",
    "MASK_ID",
    "SPECIAL_TOKENS",
    "EVAL_FRACTION",
    "SPLIT_SEED",
    "MLM_PROBABILITY",
    "NUM_DIGIT_CLASSES",
    "DIGIT_IMAGE_SIZE",
    "cache_dir",
    "corpus_text",
    "split_text",
    "get_tokenizer",
    "token_ids",
    "token_blocks",
    "random_blocks",
    "mlm_mask",
    "digits",
    "data_fingerprint",
]

# ---------------------------------------------------------------------------
# Constants (the single place where data-side sizes live)
# ---------------------------------------------------------------------------

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


# ---------------------------------------------------------------------------
# Cache directory
# ---------------------------------------------------------------------------


def cache_dir() -> Path:
    """Return the root cache directory of the benchmark suite.

    Taken from the environment variable ``SYMGRAPH_CACHE`` (read at every
    call, so tests can redirect it), defaulting to ``~/.cache/symgraph``.
    The directory is created if needed.

    Returns
    -------
    pathlib.Path
        Absolute path of the cache directory.
    """
    root = os.environ.get("SYMGRAPH_CACHE") or os.path.join("~", ".cache", "symgraph")
    path = Path(root).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


# ---------------------------------------------------------------------------
# Raw text
# ---------------------------------------------------------------------------


def _check_split(split: str) -> None:
    if split not in _SPLITS:
        raise ValueError(f"split must be one of {_SPLITS}, got {split!r}")


def _check_corpus(corpus: str) -> None:
    if corpus not in TEXT_CORPORA:
        raise ValueError(f"corpus must be one of {TEXT_CORPORA}, got {corpus!r}")


def _prose_text() -> str:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    return "\n\n".join(topics[key].strip("\n") for key in sorted(topics)) + "\n"


def _code_text(max_chars: int = CODE_MAX_CHARS) -> str:
    stdlib = Path(os.__file__).resolve().parent
    parts: list[str] = []
    total = 0
    for path in sorted(stdlib.glob("*.py")):
        if total >= max_chars:
            break
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text)
    return "".join(parts)[:max_chars]


@functools.lru_cache(maxsize=None)
def corpus_text(corpus: str) -> str:
    """Return the full raw text of a text corpus.

    Parameters
    ----------
    corpus : {"prose", "code"}
        Which corpus (see the module docstring).

    Returns
    -------
    str
        The whole corpus, deterministic for a given Python installation.
    """
    _check_corpus(corpus)
    return _prose_text() if corpus == "prose" else _code_text()


def _split_point(text: str) -> int:
    """Character index where the held-out tail starts (at a line start)."""
    cut = int(len(text) * (1.0 - EVAL_FRACTION))
    newline = text.find("\n", cut)
    return len(text) if newline < 0 else newline + 1


def split_text(corpus: str, split: str) -> str:
    """Return the train or held-out part of a text corpus.

    The last :data:`EVAL_FRACTION` of the characters, starting at a line
    boundary, form ``"eval"``; everything before forms ``"train"``. The two
    parts are disjoint and concatenate to :func:`corpus_text`.

    Parameters
    ----------
    corpus : {"prose", "code"}
        Which corpus.
    split : {"train", "eval"}
        Which part.

    Returns
    -------
    str
        The requested part of the corpus.
    """
    _check_split(split)
    text = corpus_text(corpus)
    cut = _split_point(text)
    return text[:cut] if split == "train" else text[cut:]


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------


def _train_tokenizer(text: str, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    return tokenizer


@functools.lru_cache(maxsize=None)
def get_tokenizer(corpus: str, vocab_size: int = VOCAB_SIZE):
    """Return the byte-level BPE tokenizer of a text corpus.

    Trained on the ``"train"`` split only. Loaded from the on-disk cache when
    present, otherwise trained (well under a second) and written atomically.

    Parameters
    ----------
    corpus : {"prose", "code"}
        Which corpus the tokenizer is trained on.
    vocab_size : int, optional
        Vocabulary size including the special tokens; default
        :data:`VOCAB_SIZE`.

    Returns
    -------
    tokenizers.Tokenizer
        Tokenizer with ``[PAD]`` = 0 and ``[MASK]`` = 1. ``decode(encode(s))``
        reproduces ``s`` exactly.
    """
    from tokenizers import Tokenizer

    _check_corpus(corpus)
    text = split_text(corpus, "train")
    name = f"{corpus}-bpe{vocab_size}-v{_TOKENIZER_VERSION}-{_sha(text)[:12]}.json"
    path = cache_dir() / "tokenizers" / name
    if path.exists():
        tokenizer = Tokenizer.from_file(str(path))
    else:
        tokenizer = _train_tokenizer(text, vocab_size)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tokenizer.save(str(tmp))
        os.replace(tmp, path)
    assert tokenizer.token_to_id(PAD_TOKEN) == PAD_ID
    assert tokenizer.token_to_id(MASK_TOKEN) == MASK_ID
    return tokenizer


@functools.lru_cache(maxsize=None)
def _token_ids_cached(corpus: str, split: str) -> torch.Tensor:
    tokenizer = get_tokenizer(corpus)
    text = split_text(corpus, split)
    # Encode line by line, exactly as the tokenizer was trained (line-level
    # pieces); batching the lines is also much faster than one huge string.
    lines = text.splitlines(keepends=True)
    ids = [i for enc in tokenizer.encode_batch(lines) for i in enc.ids]
    tensor = torch.tensor(ids, dtype=torch.long)
    tensor.requires_grad_(False)
    return tensor


def token_ids(corpus: str, split: str) -> torch.Tensor:
    """Return the token stream of one split of a text corpus.

    Parameters
    ----------
    corpus : {"prose", "code"}
        Which corpus.
    split : {"train", "eval"}
        Which split.

    Returns
    -------
    torch.LongTensor
        1-D tensor of token ids (a fresh clone; safe to modify).
    """
    _check_corpus(corpus)
    _check_split(split)
    return _token_ids_cached(corpus, split).clone()


def token_blocks(corpus: str, split: str, block_size: int) -> torch.Tensor:
    """Cut a split into consecutive, non-overlapping fixed-length blocks.

    The trailing remainder shorter than ``block_size`` is dropped. This is the
    deterministic layout used for evaluation.

    Parameters
    ----------
    corpus : {"prose", "code"}
        Which corpus.
    split : {"train", "eval"}
        Which split.
    block_size : int
        Tokens per block.

    Returns
    -------
    torch.LongTensor
        Tensor of shape ``(n_blocks, block_size)``.
    """
    ids = _token_ids_cached(corpus, split)
    n = len(ids) // block_size
    return ids[: n * block_size].reshape(n, block_size).clone()


def random_blocks(
    corpus: str,
    split: str,
    block_size: int,
    batch_size: int,
    generator: torch.Generator,
) -> torch.Tensor:
    """Sample a batch of blocks at random offsets of a split.

    Used for training: the data order is fully determined by ``generator``.

    Parameters
    ----------
    corpus : {"prose", "code"}
        Which corpus.
    split : {"train", "eval"}
        Which split.
    block_size : int
        Tokens per block.
    batch_size : int
        Number of blocks.
    generator : torch.Generator
        Source of randomness for the offsets (advanced in place).

    Returns
    -------
    torch.LongTensor
        Tensor of shape ``(batch_size, block_size)``.
    """
    ids = _token_ids_cached(corpus, split)
    starts = torch.randint(0, len(ids) - block_size + 1, (batch_size,), generator=generator)
    return ids[starts[:, None] + torch.arange(block_size)]


# ---------------------------------------------------------------------------
# Masked language modelling
# ---------------------------------------------------------------------------


def mlm_mask(
    input_ids: torch.Tensor,
    seed: int | None = None,
    *,
    generator: torch.Generator | None = None,
    mlm_probability: float = MLM_PROBABILITY,
    vocab_size: int = VOCAB_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply BERT-style masking to a batch of token ids.

    Each non-special token is selected independently with probability
    ``mlm_probability``. Of the selected tokens 80% are replaced by
    ``[MASK]``, 10% by a uniformly random non-special token and 10% are left
    unchanged. Labels hold the original id at selected positions and -100
    (ignored by the loss) everywhere else.

    Parameters
    ----------
    input_ids : torch.LongTensor
        Token ids of any shape; not modified.
    seed : int, optional
        Seed of a fresh generator; the result is a deterministic function of
        ``(input_ids, seed)``. Exactly one of ``seed`` and ``generator`` must
        be given.
    generator : torch.Generator, optional
        Generator to draw from (advanced in place), e.g. for per-step dynamic
        masking during training.
    mlm_probability : float, optional
        Selection probability, default :data:`MLM_PROBABILITY` (0.15).
    vocab_size : int, optional
        Vocabulary size for the random replacements.

    Returns
    -------
    masked_ids : torch.LongTensor
        Input ids after masking, same shape as ``input_ids``.
    labels : torch.LongTensor
        Original ids at selected positions, -100 elsewhere.
    """
    if (seed is None) == (generator is None):
        raise ValueError("give exactly one of seed and generator")
    if generator is None:
        generator = torch.Generator().manual_seed(int(seed))
    n_special = len(SPECIAL_TOKENS)
    shape = input_ids.shape
    is_special = input_ids < n_special
    selected = (torch.rand(shape, generator=generator) < mlm_probability) & ~is_special
    action = torch.rand(shape, generator=generator)
    random_ids = torch.randint(n_special, vocab_size, shape, generator=generator)
    to_mask = selected & (action < MLM_MASK_FRACTION)
    to_random = selected & (action >= MLM_MASK_FRACTION) & (
        action < MLM_MASK_FRACTION + MLM_RANDOM_FRACTION
    )
    masked = input_ids.clone()
    masked[to_mask] = MASK_ID
    masked[to_random] = random_ids[to_random]
    labels = torch.where(selected, input_ids, torch.full_like(input_ids, -100))
    return masked, labels


# ---------------------------------------------------------------------------
# Digits
# ---------------------------------------------------------------------------


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
    """Return one split of the scikit-learn digits dataset, shaped for a ViT.

    Parameters
    ----------
    split : {"train", "eval"}
        ``"eval"`` is the last :data:`EVAL_FRACTION` (rounded up) of a fixed
        permutation (seed :data:`SPLIT_SEED`); ``"train"`` is the rest.

    Returns
    -------
    images : torch.FloatTensor
        Shape ``(n, 1, 8, 8)``, values in [-1, 1].
    labels : torch.LongTensor
        Shape ``(n,)``, values in 0..9.
    """
    _check_split(split)
    x, y, perm = _digits_cached()
    n_eval = int(np.ceil(len(perm) * EVAL_FRACTION))
    idx = perm[: len(perm) - n_eval] if split == "train" else perm[len(perm) - n_eval :]
    idx = torch.from_numpy(np.sort(idx))
    return x[idx].clone(), y[idx].clone()


# ---------------------------------------------------------------------------
# Fingerprints (for cache keys)
# ---------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def data_fingerprint(dataset: str) -> str:
    """Return a short hash identifying the exact contents of a dataset.

    Used in cache keys so that checkpoints trained on a different Python
    installation (hence a different standard library or ``pydoc`` text) are
    never silently reused.

    Parameters
    ----------
    dataset : {"prose", "code", "digits"}
        Which dataset.

    Returns
    -------
    str
        12 hexadecimal characters.
    """
    if dataset == "digits":
        x, y, perm = _digits_cached()
        h = hashlib.sha256()
        for arr in (x.numpy(), y.numpy(), perm):
            h.update(np.ascontiguousarray(arr).tobytes())
        return h.hexdigest()[:12]
    _check_corpus(dataset)
    return _sha(f"{VOCAB_SIZE}|{EVAL_FRACTION}|{corpus_text(dataset)}")[:12]
