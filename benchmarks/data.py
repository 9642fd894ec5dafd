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

__all__ = ["TEXT_CORPORA", "VOCAB_SIZE", "PAD_TOKEN", "MASK_TOKEN", "PAD_ID", "MASK_ID", "SPECIAL_TOKENS",
           "EVAL_FRACTION", "SPLIT_SEED", "MLM_PROBABILITY", "NUM_DIGIT_CLASSES", "DIGIT_IMAGE_SIZE", "cache_dir",
           "corpus_text", "split_text", "get_tokenizer", "token_ids", "token_blocks", "random_blocks", "mlm_mask",
           "digits", "data_fingerprint"]

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
    """The whole raw text of ``corpus`` ("prose" or "code", see :mod:`benchmarks.data`),
    deterministic for a given Python installation."""
    _check_corpus(corpus)
    return _prose_text() if corpus == "prose" else _code_text()


def _split_point(text: str) -> int:
    """Character index where the held-out tail starts (at a line start)."""
    cut = int(len(text) * (1.0 - EVAL_FRACTION))
    newline = text.find("\n", cut)
    return len(text) if newline < 0 else newline + 1


def split_text(corpus: str, split: str) -> str:
    """``split`` of ``corpus``: the last :data:`EVAL_FRACTION` of the characters, from a line
    start, is "eval", the rest "train" (disjoint; together :func:`corpus_text`)."""
    _check_split(split)
    text = corpus_text(corpus)
    cut = _split_point(text)
    return text[:cut] if split == "train" else text[cut:]


def _train_tokenizer(text: str, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), min_frequency=2,
                                  show_progress=False)
    tokenizer.train_from_iterator(text.splitlines(keepends=True), trainer=trainer)
    return tokenizer


@functools.lru_cache(maxsize=None)
def get_tokenizer(corpus: str, vocab_size: int = VOCAB_SIZE):
    """The byte-level BPE tokenizer of ``corpus``'s "train" split (``vocab_size`` entries, the
    special tokens included: ``[PAD]`` = 0, ``[MASK]`` = 1; ``decode(encode(s)) == s``), from the
    on-disk cache, else trained (well under a second) and written atomically."""
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
    """The token ids of ``split`` ("train" or "eval") of ``corpus`` ("prose" or "code"), 1-D (a
    fresh clone: safe to modify)."""
    _check_corpus(corpus)
    _check_split(split)
    return _token_ids_cached(corpus, split).clone()


def token_blocks(corpus: str, split: str, block_size: int) -> torch.Tensor:
    """:func:`token_ids` cut into consecutive blocks, ``(n_blocks, block_size)`` (the shorter
    remainder dropped): the deterministic layout of evaluation."""
    ids = _token_ids_cached(corpus, split)
    n = len(ids) // block_size
    return ids[: n * block_size].reshape(n, block_size).clone()


def random_blocks(corpus: str, split: str, block_size: int, batch_size: int,
                  generator: torch.Generator) -> torch.Tensor:
    """``batch_size`` blocks of :func:`token_ids` at random offsets, ``(batch_size, block_size)``:
    training's batches, their order fully determined by ``generator`` (advanced in place)."""
    ids = _token_ids_cached(corpus, split)
    starts = torch.randint(0, len(ids) - block_size + 1, (batch_size,), generator=generator)
    return ids[starts[:, None] + torch.arange(block_size)]


def mlm_mask(input_ids: torch.Tensor, seed: int | None = None, *, generator: torch.Generator | None = None,
             mlm_probability: float = MLM_PROBABILITY,
             vocab_size: int = VOCAB_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """``(masked ids, labels)``: BERT-style masking of ``input_ids`` (any shape; not modified).
    Each non-special token is selected with probability ``mlm_probability``; of those 80% become
    ``[MASK]``, 10% a uniformly random non-special token below ``vocab_size``, 10% stay. Labels:
    the original id where selected, -100 (ignored by the loss) elsewhere. Exactly one of ``seed``
    (a fresh generator: a deterministic function of ``(input_ids, seed)``) and ``generator``
    (advanced in place, e.g. per-step dynamic masking in training)."""
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
